"""Making room for a store: eviction through the namespace's policy (all or nothing per call)
and per-tenant admission (tenants.py), both dropping victims one way.

Methods of `Pool` (pool.py composes them); each runs under, or takes, `self._lock` as the
pool's thread contract says. Imports only pool_state and pool_types.
"""

from __future__ import annotations

import logging
from collections.abc import Container, Sequence

from kvoffload_sidecar.index import SlotIndex
from kvoffload_sidecar.keys import PoolKey
from kvoffload_sidecar.pool_state import NamespaceState
from kvoffload_sidecar.tenants import KeySalts, TenantPolicy

log = logging.getLogger("kvoffload_sidecar.pool")


class _Protected:
    """`protected` for `CachePolicy.evict`: pinned keys and the keys of the current request."""

    __slots__ = ("_index", "_request")

    def __init__(self, index: SlotIndex, request: set[PoolKey]) -> None:
        self._index = index
        self._request = request

    def __contains__(self, key: object) -> bool:
        return key in self._request or self._index.is_pinned_key(key)


class PoolEviction:
    """`Pool`'s eviction part (pool.py)."""

    def _admit_tenants(
        self,
        ns: NamespaceState,
        tenants: TenantPolicy,
        key_list: list[PoolKey],
        fresh: list[PoolKey],
        salts: KeySalts | None,
    ) -> tuple[list[PoolKey], list[PoolKey], int | list[int]]:
        """Lock held: per tenant of the batch (tenants.py), how many of its fresh keys it may
        store, with the victims evicted to make room. Returns the admitted keys (key order),
        the refused ones (NO_SPACE) and the admitted keys' tenant (one, or one per key)."""
        owners = tenants.key_tenants(salts, len(key_list))
        groups: dict[int, list[PoolKey]]
        if type(owners) is int:
            groups = {owners: fresh}
        else:
            first = dict(zip(reversed(key_list), reversed(owners), strict=True))  # first wins
            groups = {}
            for key in fresh:
                groups.setdefault(first[key], []).append(key)
        self._apply_touches(ns)
        protected = self._protected(ns.index, key_list)
        may_evict = not (self._evict_from and self._clock() < self._evict_from)
        available = ns.free.available()
        admitted: list[PoolKey] = []
        refused: list[PoolKey] = []
        for tenant, keys in groups.items():
            count, victims = tenants.admit(
                tenant, len(keys), available, protected, may_evict=may_evict
            )
            if victims:
                self._drop_victims(ns, victims)
            available += len(victims) - count
            admitted += keys[:count]
            refused += keys[count:]
        if len(groups) == 1:
            (tenant,) = groups
            return admitted, refused, tenant
        kept = set(admitted)
        admitted = [k for k in fresh if k in kept]  # key order, as the index reserves them
        return admitted, refused, [first[k] for k in admitted]

    @staticmethod
    def _protected(index: SlotIndex, request: Sequence[PoolKey]) -> Container[PoolKey]:
        """What eviction must spare: the request's keys and, when any, the pinned keys."""
        if not index.counts.pinned:
            return set(request)  # a plain set: membership tests stay in C
        return _Protected(index, set(request))

    def _evict(self, ns: NamespaceState, n: int, protected: Container[PoolKey]) -> None:
        """Free `n` slots by eviction, or as many as the policy can give when fewer are evictable.

        `evict` is all-or-nothing, so on a refusal ask for half as many and keep going: at most
        O(log n) refused calls, ending with every evictable victim gone when n is out of reach.
        """
        self._apply_touches(ns)
        if self._evict_from and self._clock() < self._evict_from:
            return  # adopted blocks may still be read by the dead instance's clients' loads
        ask = n
        while n > 0 and ask > 0:
            victims = ns.policy.evict(ask, protected)
            if victims is None:
                ask //= 2
                continue
            self._drop_victims(ns, victims)
            n -= len(victims)
            ask = min(ask, n)

    @staticmethod
    def _drop_victims(ns: NamespaceState, victims: Sequence[PoolKey]) -> None:
        """Lock held: evicted keys leave the index (their slots free), counted and logged for KV
        events; the one place both eviction paths (`_evict`, `_admit_tenants`) go through."""
        ns.free.release_many(ns.index.evict_many(victims))
        ns.counters.evicted_blocks += len(victims)
        if ns.events is not None:
            ns.events.removed(victims)
