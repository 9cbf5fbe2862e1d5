"""The pool file's life: start, the pre-fault frontier, a file lost under the sidecar (rebuilt
in place), drain and close.

Methods of `Pool` (pool.py composes them); each runs under, or takes, `self._lock` as the
pool's thread contract says. Imports only pool_state and pool_types.
"""

from __future__ import annotations

import logging
from pathlib import Path

from kvoffload_sidecar import persist
from kvoffload_sidecar.pool_state import NamespaceState
from kvoffload_sidecar.region import Region

log = logging.getLogger("kvoffload_sidecar.pool")


class PoolLifecycle:
    """`Pool`'s lifecycle part (pool.py)."""

    @property
    def path(self) -> Path:
        return self._region.path

    @property
    def region(self) -> Region:
        return self._region

    def start(self) -> None:
        """Create and size the pool file, start the pre-fault (OSError/ValueError if unusable)."""
        with self._lock:
            if self._started:
                return
            self._region.open()
            self._started = True
            self._started_at = self._clock()
            self._open_index()
        self._region.start_prefault()
        with self._lock:
            self._on_prefault_progress()
        log.info(
            "pool %s: %d bytes in %s, %d partition(s), eviction %s",
            self.generation,
            self.settings.pool_size,
            self._region.name,
            self.settings.max_namespaces,
            self.settings.eviction,
        )

    def close(self, *, remove: bool = False) -> None:
        """Stop the pre-fault and unmap; the pool is unusable afterwards. The file stays (the
        next sidecar of the pod adopts it) unless `remove`."""
        with self._lock:
            self._namespaces.clear()  # their slot tables are views of the mapping
            self._clients.clear()
            if self._presence is not None:  # connectors still mapping it keep their copy
                self._presence.close()
                self._presence = None
            self._partitions = [None] * len(self._partitions)
        self._region.close(remove=remove)
        with self._lock:
            self._started = False
            self._draining = True

    def check_file(self) -> bool:
        """The reaper tick: when the pool file was truncated, removed or replaced under us,
        rebuild the pool in place (file sized and pre-faulted again, a new generation, every
        namespace and client forgotten: the contents are gone). True when it rebuilt; the
        caller then ends every session, so the connectors register again and re-map."""
        with self._lock:
            if not self._started or self._draining:
                return False
            problem = self._region.file_problem()
        if problem is None:
            return False
        self._region.stop_prefault()  # before re-sizing: it must not touch a short file
        with self._lock:
            if not self._started or self._draining:
                return False
            old = self.generation
            for ns in list(self._namespaces.values()):
                self._drop_namespace(ns)
            self._ready_event.clear()
            # Copies a connector still had in flight may land in the file: stores wait until
            # no worker holds a lock of the old generation (each drains before it re-maps).
            self._new_generation()
            self._writers_clear = False
            self.rebuilds += 1
            self._evict_from = 0.0
            try:
                self._region.rebuild()
                persist.write_header(self._region.buffer, self._geometry, self.generation)
            except (OSError, ValueError) as exc:
                self._started = False  # every call answers FAILED_PRECONDITION from now on
                log.error(
                    "%s %s and cannot be rebuilt (%s): serving without a pool",
                    self._region.name,
                    problem,
                    exc,
                )
                return True
        log.warning(
            "%s %s under the sidecar: rebuilt it (generation %s -> %s), its "
            "contents are gone; connectors register again",
            self._region.name,
            problem,
            old,
            self.generation,
        )
        self._region.start_prefault()
        with self._lock:
            self._on_prefault_progress()
        return True

    def open_stores(self) -> int:
        """Store reservations not yet committed or aborted (all namespaces)."""
        with self._lock:
            return sum(len(ns.index.stores) for ns in self._namespaces.values())

    def begin_drain(self) -> None:
        """Refuse new registrations and reservations (Unavailable); commits/releases still work."""
        with self._lock:
            self._draining = True

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the pre-fault finished; False on timeout."""
        return self._ready_event.wait(timeout)

    def _on_prefault_progress(self) -> None:
        """Lock held: move every namespace's allocatable frontier to the pre-faulted bytes."""
        for ns in self._namespaces.values():
            self._update_ready(ns)
        if self._region.done:
            self._ready_event.set()

    def _update_ready(self, ns: NamespaceState) -> None:
        if ns.free.ready >= ns.slot_count:
            return
        ready = ns.slot_count
        for r in ns.regions:
            got = self._region.ready_prefix(r.offset, r.slot_count * r.slot_bytes)
            ready = min(ready, got // r.slot_bytes)
        ns.free.set_ready(ready)

    def _set_prefault_priority(self) -> None:
        ranges = [
            (r.offset, r.slot_count * r.slot_bytes)
            for ns in self._namespaces.values()
            for r in ns.regions
        ]
        self._region.set_priority(ranges)
