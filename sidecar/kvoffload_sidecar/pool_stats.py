"""What `Stats` answers: pool-wide and per-namespace counters and gauges.

Methods of `Pool` (pool.py composes them); each runs under, or takes, `self._lock` as the
pool's thread contract says. Imports only pool_state and pool_types.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from kvoffload_sidecar.pool_state import NamespaceState
from kvoffload_sidecar.pool_types import (
    NamespaceStats,
    PoolStats,
)

log = logging.getLogger("kvoffload_sidecar.pool")


class PoolObservation:
    """`Pool`'s stats part (pool.py)."""

    def stats(self) -> PoolStats:
        with self._lock:
            now = self._clock()
            region = self._region
            return PoolStats(
                pool_bytes=self.settings.pool_size,
                prefaulted_bytes=region.prefaulted_bytes,
                pool_ready=region.done,
                eviction_policy=self.settings.eviction,
                pool_generation=self.generation,
                namespaces=tuple(self._ns_stats(ns, now) for ns in self._namespaces.values()),
                uptime_seconds=now - self._started_at,
                adoption=replace(self.adoption, discarded=dict(self.adoption.discarded)),
            )

    def live_client_ids(self) -> frozenset[int]:
        """Ids of the registered clients not detached, reaped or idle past the timeout."""
        with self._lock:
            now = self._clock()
            return frozenset(
                cid for cid, client in self._clients.items() if self._is_live(client, now)
            )

    def _ns_stats(self, ns: NamespaceState, now: float) -> NamespaceStats:
        c, k, sb = ns.index.counts, ns.counters, ns.slot_bytes
        return NamespaceStats(
            namespace_id=ns.namespace_id,
            spec=ns.spec,
            num_ranks=ns.num_ranks,
            slot_bytes=sb,
            slot_count=ns.slot_count,
            committed_slots=c.committed,
            reserved_slots=c.reserved,
            pinned_slots=c.pinned,
            live_clients=sum(1 for cid in ns.clients if self._is_live(self._clients[cid], now)),
            capacity_bytes=ns.slot_count * sb,
            used_bytes=(c.committed + c.reserved) * sb,
            pinned_bytes=c.pinned * sb,
            lookups=k.lookups,
            hit_blocks=k.hit_blocks,
            miss_blocks=k.miss_blocks,
            queried_blocks=k.queried_blocks,
            stored_blocks=k.stored_blocks,
            loaded_blocks=k.loaded_blocks,
            evicted_blocks=k.evicted_blocks,
            stored_bytes=k.stored_blocks * sb,
            loaded_bytes=k.loaded_blocks * sb,
            tenants=ns.tenants.stats(sb) if ns.tenants is not None else (),
            refused_commits=k.refused_commits,
            unlocked_reservations=k.unlocked_reservations,
            withheld_slots=len(ns.withheld),
            prefaulted_slots=ns.free.ready,
        )
