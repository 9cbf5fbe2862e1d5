"""Whether the scheduler may use the pool now, and its registration (no torch).

The pool is usable once the scheduler is registered and every rank has its pool mapped and at
least its first piece registered with its device. Each rank registers its region in pieces
(`PoolView.usable_end`) and reports how far it got (at engine start in vLLM's handshake
metadata, then in its step reports when it grows): loads are planned only for chunks whose
slots lie below every rank's end (`_slot_limit`), a hit past it is a miss, and a store reserved
past it is aborted before any copy (store_jobs.py). Before the first registration requests
wait for it (bounded by `register_wait_ms`); a rank that found no pool stops that wait; a hit
waits (bounded by `ready_wait_ms`) only while a rank has no piece registered at all. The
registration comes from the workers: at engine start through vLLM's handshake metadata
(`on_handshake`), and in the step reports after any re-registration; the scheduler joins their
namespace on its RPC thread. Part of `OffloadScheduler` (scheduler.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from kvoffload_connector.common.client import PoolUnavailable
from kvoffload_connector.common.config import Placement
from kvoffload_connector.common.metadata import Registration

# the scheduler side logs as one logger, whichever part of it speaks
log = logging.getLogger("kvoffload_connector.scheduler")


class PoolReadiness:
    """Pool readiness and registration (a part of `OffloadScheduler`)."""

    @property
    def registered(self) -> bool:
        return self.client.connected

    def _usable(self) -> bool:
        """Connected, and every rank has its pool mapped and some of it device-registered."""
        return self.client.connected and self._ranks_ready()

    def _ranks_ready(self) -> bool:
        """Every rank may copy some slots (not reported yet counts as all)."""
        return self._slot_limit() != 0

    def _slot_limit(self) -> int | None:
        """Slots [0, n) that every rank has registered with its device; None: no limit (every
        rank registered its whole region, or none has reported yet); 0: some rank has none."""
        if not self._ready:
            return None
        if len(self._ready) < self.world_size:
            return 0
        partial = [self._usable_end.get(r, 0) for r, ok in self._ready.items() if not ok]
        return min(partial) if partial else None

    def _note_ranks(self, ready: Mapping[int, bool], usable: Mapping[int, int]) -> None:
        """What ranks said of their mapping: registered whole (`ready`), or up to a slot."""
        self._ready.update(ready)
        self._usable_end.update(usable)
        for r in usable:
            self._ready.setdefault(r, False)
        if self._ranks_ready():
            self._unready_since = None
        elif self._unready_since is None:
            self._unready_since = self._clock()

    def _loadable_chunks(self, answer) -> int:
        """How many of a hit's chunks lie below every rank's registered end (a prefix)."""
        limit = self._slot_limit()
        if limit is None:
            return answer.hit_chunks
        for c in range(answer.hit_chunks):
            for group in answer.slots:
                slot = group[c] if c < len(group) else None
                if slot is not None and slot >= limit:
                    return c
        return answer.hit_chunks

    def _waiting_for_ranks(self) -> bool:
        """Connected while a rank maps the pool for its device, for at most `ready_wait_ms`
        since it started: lookups still run, and a request that hits waits for it (a miss
        does not)."""
        since = self._unready_since
        return (
            since is not None
            and not self._no_pool
            and self.client.connected
            and (self._clock() - since) * 1e3 < self.cfg.ready_wait_ms
        )

    def _unusable_reason(self) -> str:
        if not self.client.connected:
            if self._registration is None:
                return "no worker has reported a registration yet"
            server = "the node agent" if self.cfg.placement is Placement.NODE else "the sidecar"
            return f"{server} is away or refused the registration (retrying)"
        missing = [
            r
            for r in range(self.world_size)
            if not self._ready.get(r) and not self._usable_end.get(r)
        ]
        return f"rank(s) {missing} have no mapped pool"

    def no_pool_reason(self) -> str:
        """Why requests are served without the pool now ("" while it serves them), for the
        status file: what a worker found at its first registration, or why it is unusable
        (with the client's last registration error)."""
        if self._usable():
            return ""
        if self._no_pool and not self.client.connected:
            return self._no_pool
        reason = self._unusable_reason()
        error = "" if self.client.connected else getattr(self.client, "last_error", "")
        return f"{reason}: {error}" if error else reason

    def _tell_unusable(self) -> None:
        """One log line per reason (not per step) for serving without the pool."""
        reason = self._unusable_reason()
        if reason != self._told_unusable:
            self._told_unusable = reason
            log.info("kvoffload: serving without the pool (lookups miss, stores drop): %s", reason)

    def _may_wait_for_registration(self) -> bool:
        """Before the first registration, requests wait (bounded) instead of missing; not once a
        rank said it found no pool (a degraded sidecar, a layout it cannot map)."""
        if self._registration is not None and self.client.registrations > 0:
            return False  # registered before: the sidecar is away, do not wait for it
        if self._no_pool:
            return False
        now = self._clock()
        if self._first_query_at is None:
            self._first_query_at = now
        return (now - self._first_query_at) * 1e3 < self.cfg.register_wait_ms

    def on_handshake(
        self,
        registrations: Mapping[int, Registration],
        mapped: Mapping[int, tuple[bool, int]] | None = None,
    ) -> None:
        """The workers' registrations as vLLM collects them at engine start (rank -> its
        registration, `set_xfer_handshake_metadata`): the scheduler joins their namespace on
        the RPC thread then, not at the first step's report, so its KV events announce a warm
        pool before any request and the first step's stores can be reserved. `mapped`: rank ->
        (registered whole, slots registered so far), as the step reports carry them later.
        Never blocks."""
        if mapped:
            self._note_ranks(
                {r: ok for r, (ok, _) in mapped.items()},
                {r: end for r, (_, end) in mapped.items()},
            )
        if not registrations:
            return
        reg = registrations[min(registrations)]
        if reg != self._registration:
            self._registration = reg
            self._rpc.submit(lambda: self._register(reg))

    def _register(self, reg: Registration) -> None:
        cur = self.client.registration
        if (
            self.client.connected
            and cur is not None
            and cur.namespace_id == reg.namespace_id
            and cur.generation == reg.generation
        ):
            # Already joined (we reconnected first): keep the session and the pins it owns.
            self.client.remember(reg.spec, reg.num_ranks, reg.slot_bytes_per_rank)
            return
        try:
            self.client.register(reg.spec, reg.num_ranks, reg.slot_bytes_per_rank)
        except PoolUnavailable as e:
            log.info("kvoffload: scheduler registration failed (will retry): %s", e)
