"""Engine ownership of store reservations: which engines are armed (every rank holds its lock),
which are dead (none does), and the slots withheld since adoption, freed by death or by
every rank's drained report (docs/POOL.md, the invariant).

Methods of `Pool` (pool.py composes them); each runs under, or takes, `self._lock` as the
pool's thread contract says. Imports only pool_state and pool_types.
"""

from __future__ import annotations

import logging

import numpy as np

from kvoffload_sidecar import persist
from kvoffload_sidecar.engine_locks import (
    MAX_ENGINE,
    engine_offset,
)
from kvoffload_sidecar.errors import (
    FailedPrecondition,
    InvalidArgument,
)
from kvoffload_sidecar.pool_state import (
    EngineState,
    NamespaceState,
    is_int,
)

log = logging.getLogger("kvoffload_sidecar.pool")


class PoolReclaim:
    """`Pool`'s reclaim part (pool.py)."""

    def reclaim_dead_engines(self) -> int:
        """Probe every engine with open reservations (and the owners of slots withheld since
        adoption): those no rank holds a lock for are dead, and their slots free. Returns the
        slots freed. The reaper calls it each tick."""
        with self._lock:
            return self._reclaim_dead_engines()

    def report_drained(
        self, namespace_id: str, client_id: int, *, epoch: int, engine: int, rank: int
    ) -> int:
        """Rank `rank` of `engine`, over its registration with this instance (`epoch`), has no
        copy in flight into a reservation another sidecar instance answered and starts none
        from now on. Once every rank of the engine reported, the slots withheld at adoption
        for it are free (no process of it may still write them). Returns the slots freed."""
        with self._lock:
            ns = self._namespace(namespace_id)
            self._owned_client(ns, client_id)
            if not is_int(epoch) or epoch != self.epoch:
                raise FailedPrecondition(
                    f"drained report names sidecar instance {epoch!r}, this is {self.epoch:#x}"
                )
            if not is_int(engine) or not 0 < engine < MAX_ENGINE:
                raise InvalidArgument(f"engine must be in 1..{MAX_ENGINE - 1}, got {engine!r}")
            if not is_int(rank) or not 0 <= rank < ns.num_ranks:
                raise InvalidArgument(f"rank must be in 0..{ns.num_ranks - 1}, got {rank!r}")
            ranks = ns.drained.setdefault(engine, set())
            ranks.add(rank)
            if len(ranks) < ns.num_ranks or not len(ns.withheld):
                return 0
            return self._free_withheld(ns, ns.withheld_owners == engine)

    def _free_withheld(self, ns: NamespaceState, gone: np.ndarray) -> int:
        """Lock held: the withheld slots where `gone` is set are free (file table, free list)."""
        slots = ns.withheld[gone]
        if not len(slots):
            return 0
        if self._region.intact():
            ns.table.mark(slots, persist.FREE)
        ns.free.release_many(slots)
        ns.withheld, ns.withheld_owners = ns.withheld[~gone], ns.withheld_owners[~gone]
        log.info(
            "namespace %s: %d withheld slot(s) free (their engines drained or died)",
            ns.namespace_id,
            len(slots),
        )
        return len(slots)

    def _engine_alive(self, ns: NamespaceState, engine: int) -> bool:
        """Lock held: some rank of `engine` holds its lock (it may still write)."""
        if not 0 < engine < MAX_ENGINE:  # not a key a worker can lock: nobody writes for it
            return False
        return self._liveness(engine_offset(self.lock_base, engine), ns.num_ranks)

    def _engine_armed(self, ns: NamespaceState, engine: int) -> bool:
        """Lock held: every rank of `engine` holds its lock, so any process that may write its
        reservations' slots is seen by the death probe. Remembered until it dies."""
        record = ns.engines.get(engine)
        if record is not None and record.armed:
            return True
        base = self.lock_base
        if not all(self._liveness(engine_offset(base, engine, r), 1) for r in range(ns.num_ranks)):
            return False
        if record is None:
            record = ns.engines[engine] = EngineState(engine)
        record.armed = True
        return True

    def _reclaim_dead_engines(self) -> int:
        """Lock held: `reclaim_dead_engines`."""
        freed = 0
        for ns in self._namespaces.values():
            for engine, record in list(ns.engines.items()):
                if self._engine_alive(ns, engine):
                    continue
                for store_id in list(record.stores):
                    freed += len(self._abort(ns, store_id)[1])
                if record.stores or record.armed:
                    log.info("engine %d of namespace %s is gone: its reservations are free",
                             engine, ns.namespace_id)  # fmt: skip
                del ns.engines[engine]
            if len(ns.withheld):
                owners = ns.withheld_owners
                dead = [o for o in np.unique(owners).tolist() if not self._engine_alive(ns, o)]
                if dead:
                    freed += self._free_withheld(ns, np.isin(owners, np.asarray(dead, np.uint64)))
        return freed
