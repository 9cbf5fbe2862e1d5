"""Lookups, load pins with their slot versions, releases, KV event pages and the deferred
policy touches of hits.

Methods of `Pool` (pool.py composes them); each runs under, or takes, `self._lock` as the
pool's thread contract says. Imports only pool_state and pool_types.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import numpy as np

from kvoffload_sidecar.errors import (
    InvalidArgument,
    NotFound,
)
from kvoffload_sidecar.events import EventPage
from kvoffload_sidecar.keys import (
    MAX_KEYS_PER_CALL,
    check_packed,
    split_keys,
)
from kvoffload_sidecar.pool_state import NamespaceState
from kvoffload_sidecar.pool_types import (
    DEFER_TOUCH_MIN,
    MAX_DEFERRED_TOUCHES,
    LoadPin,
)

log = logging.getLogger("kvoffload_sidecar.pool")


class PoolLookups:
    """`Pool`'s lookups part (pool.py)."""

    def lookup(
        self, namespace_id: str, queries: Sequence[bytes], salts: Sequence[str] | None = None
    ) -> list[int]:
        """Per query (packed keys): length of the longest committed prefix. Touches the hits.
        `salts`: per query, its request's cache salt (per-tenant counts with --tenants)."""
        with self._lock:
            ns = self._namespace(namespace_id)
            checked = self._check_queries(ns, queries)
            index = ns.index
            hits: list[int] = []
            for packed, _ in checked:
                slots = index.committed_prefix_packed(packed)
                n = len(slots)
                hits.append(n)
                if n:
                    self._touch_packed(ns, packed, n)
                    self._record_use(ns, slots)
            self._count_lookups(ns, checked, hits, salts)
            return hits

    def count_misses(
        self, namespace_id: str, queries: Sequence[bytes], salts: Sequence[str] | None = None
    ) -> list[int]:
        """Count queries a client answered as misses itself (its presence map) as lookups
        that found nothing, as `lookup` would have then; nothing is looked up or touched now
        (a block stored since would count as a hit and move up the eviction order)."""
        with self._lock:
            ns = self._namespace(namespace_id)
            checked = self._check_queries(ns, queries)
            hits = [0] * len(checked)
            self._count_lookups(ns, checked, hits, salts)
            return hits

    def _count_lookups(
        self,
        ns: NamespaceState,
        checked: list[tuple[bytes, int]],
        hits: list[int],
        salts: Sequence[str] | None,
    ) -> None:
        """Lock held: the lookup counters (per namespace and tenant) of answered queries."""
        counters = ns.counters
        for hit, (_, n_keys) in zip(hits, checked, strict=True):
            counters.hit_blocks += hit
            counters.queried_blocks += n_keys
            if hit < n_keys:
                counters.miss_blocks += 1
        counters.lookups += len(checked)
        if ns.tenants is not None:
            for i, (hit, (_, n_keys)) in enumerate(zip(hits, checked, strict=True)):
                salt = salts[i] if salts is not None and i < len(salts) else None
                ns.tenants.count_lookup(salt, hit, n_keys)
        ns.last_used = self._clock()

    def reserve_load(
        self,
        namespace_id: str,
        client_id: int,
        keys: bytes,
        *,
        count_lookup: bool = False,
        cache_salt: str = "",
    ) -> LoadPin:
        """Pin the longest committed prefix of `keys` for reading until `release`;
        `count_lookup`: also count it as a lookup of `keys` (a lookup and pin in one call), for
        the tenant of `cache_salt` too (--tenants)."""
        with self._lock:
            self._check_serving()
            ns = self._namespace(namespace_id)
            client = self._owned_client(ns, client_id)
            packed, n_keys = check_packed(keys, ns.spec.key_size)
            pin_id = self._next_pin
            record = ns.index.pin_prefix_packed(pin_id, client.client_id, packed)
            if count_lookup:
                n = len(record.slots) if record is not None else 0
                ns.counters.lookups += 1
                ns.counters.hit_blocks += n
                ns.counters.miss_blocks += n < n_keys
                ns.counters.queried_blocks += n_keys
                ns.last_used = self._clock()
                if ns.tenants is not None:
                    ns.tenants.count_lookup(cache_salt, n, n_keys)
            if record is None:
                return LoadPin(0, ())
            self._next_pin += 1
            client.pins.add(pin_id)
            n = len(record.slots)
            self._touch_packed(ns, packed, n)
            self._record_use(ns, record.slots)
            ns.counters.loaded_blocks += n
            return LoadPin(pin_id, record.slots, self._versions(ns, record.slots))

    def _versions(self, ns: NamespaceState, slots: Sequence[int] | np.ndarray) -> Sequence[int]:
        """Lock held: the committed slots' versions (their records' state words); zeros, which
        no load accepts, when the file cannot be read."""
        if not self._region.intact():
            return np.zeros(len(slots), np.uint64)
        if isinstance(slots, np.ndarray):
            return ns.table.versions(slots)
        state = ns.table.state
        return tuple(int(state[slot]) for slot in slots)

    def release(self, namespace_id: str, client_id: int, pin_ids: Sequence[int]) -> int:
        """Drop pins taken by `reserve_load`; all or nothing. Returns the slots released."""
        with self._lock:
            ns = self._namespace(namespace_id)
            client = self._owned_client(ns, client_id)
            if isinstance(pin_ids, (bytes, str)):
                raise InvalidArgument("pin_ids must be a sequence of integers")
            ids = list(pin_ids)
            if len(ids) > MAX_KEYS_PER_CALL:
                raise InvalidArgument(
                    f"{len(ids)} pin ids in one release, at most {MAX_KEYS_PER_CALL}"
                )
            for pin_id in ids:
                self._check_id(pin_id, "pin id")
            if len(set(ids)) != len(ids):
                raise InvalidArgument("pin ids repeat in one release")
            for pin_id in ids:
                if pin_id not in client.pins:
                    raise NotFound(f"pin {pin_id} is unknown or not client {client_id}'s")
            released = 0
            for pin_id in ids:
                released += ns.index.unpin(pin_id)
                client.pins.discard(pin_id)
            return released

    def events(
        self, namespace_id: str, log_id: str, after_seq: int, cursor: int, max_events: int
    ) -> EventPage:
        """Blocks that became visible or were evicted since the caller's position in the
        namespace's event log, or a page of a snapshot of every visible block (events.py)."""
        with self._lock:
            ns = self._namespace(namespace_id)
            assert ns.events is not None  # every namespace gets its log at creation
            self._apply_touches(ns)
            return ns.events.page(log_id, after_seq, cursor, max_events, ns.policy.keys())

    def _record_use(self, ns: NamespaceState, slots: Sequence[int] | np.ndarray) -> None:
        """Lock held: hit slots' last use in the file, so an adopter keeps the LRU order."""
        if self._region.intact():
            ns.table.touch(slots, self._commit_seq)
            self._commit_seq += 1

    def flush_deferred(self) -> None:
        """Apply the deferred policy touches of lookups and loads now.

        `lookup` and `reserve_load` queue their hits' `policy.touch` instead of running it
        (~25 µs per 1,024 keys): the servicer calls this right after it has sent the answer, so
        the touch runs while the reply travels instead of before it. Every policy read or
        change (evict, insert, invariant checks) applies the queue first, in call order, so the
        policy's state and every eviction decision are exactly those of touching at once.
        """
        if not self._deferred:  # the usual case after a small call: no lock taken
            return
        with self._lock:
            self._deferred = False
            for ns in self._namespaces.values():
                self._apply_touches(ns)

    def _touch_packed(self, ns: NamespaceState, packed: bytes, n: int) -> None:
        """`policy.touch` of the first n packed keys, deferred (still packed: cutting them into
        keys waits too) until `flush_deferred` or the next policy use; a few keys are touched
        at once instead, cheaper than queueing, when nothing is queued."""
        ks = ns.spec.key_size
        hit = packed if n * ks == len(packed) else packed[: n * ks]
        if n < DEFER_TOUCH_MIN and not ns.touches:
            ns.policy.touch(split_keys(hit, ks))
            return
        ns.touches.append(hit)
        ns.touched += n
        self._deferred = True
        if ns.touched > MAX_DEFERRED_TOUCHES:
            self._apply_touches(ns)

    @staticmethod
    def _apply_touches(ns: NamespaceState) -> None:
        if ns.touches:
            touch, ks = ns.policy.touch, ns.spec.key_size
            for packed in ns.touches:
                touch(split_keys(packed, ks, max_keys=len(packed)))
            ns.touches.clear()
            ns.touched = 0

    @staticmethod
    def _check_queries(ns: NamespaceState, queries: Iterable[bytes]) -> list[tuple[bytes, int]]:
        """(packed keys, key count) per query, every one checked before any is looked up."""
        if isinstance(queries, (bytes, str)):
            raise InvalidArgument("queries must be a sequence of packed key lists")
        out: list[tuple[bytes, int]] = []
        total = 0
        for q in queries:
            if len(out) >= MAX_KEYS_PER_CALL:
                raise InvalidArgument(f"more than {MAX_KEYS_PER_CALL} queries in one lookup")
            packed, n = check_packed(q, ns.spec.key_size)
            total += n
            if total > MAX_KEYS_PER_CALL:
                raise InvalidArgument(f"more than {MAX_KEYS_PER_CALL} keys in one lookup")
            out.append((packed, n))
        return out
