"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Iterator
from itertools import filterfalse, islice

from kvoffload_sidecar.keys import PoolKey
from kvoffload_sidecar.policies.base import consume

__all__ = ["LRUPolicy"]


class LRUPolicy:
    """One `OrderedDict` from the least (front) to the most (back) recently used key.

    `evict` walks from the front, skipping protected (pinned) keys, and removes the first `n`
    others; it removes nothing when fewer than `n` exist.
    """

    name = "lru"

    def __init__(self, capacity: int = 0) -> None:
        del capacity  # LRU needs no size; the argument keeps the factory uniform
        self._order: OrderedDict[PoolKey, None] = OrderedDict()

    def insert(self, key: PoolKey) -> None:
        self._order[key] = None  # a new key goes to the back (the protocol: never held already)

    def insert_many(self, keys: Iterable[PoolKey]) -> None:
        """`insert` of each key, oldest first, in one C pass (adopting a pool's blocks; into an
        empty policy `fromkeys` is 3x faster than `update`)."""
        if self._order:
            self._order.update(dict.fromkeys(keys))
        else:
            self._order = OrderedDict.fromkeys(keys)

    def remove(self, key: PoolKey) -> None:
        self._order.pop(key, None)

    def touch(self, keys: Iterable[PoolKey]) -> None:
        keys = keys if type(keys) in (list, tuple) else list(keys)  # iterated twice below
        order = self._order
        try:
            consume(map(order.move_to_end, keys))  # the pool touches held keys: all in C
        except KeyError:  # some key is not held: redo in order, skipping those (same result)
            for key in keys:
                if key in order:
                    order.move_to_end(key)

    def evict(self, n: int, protected: Container[PoolKey]) -> list[PoolKey] | None:
        if n <= 0:
            return []
        if n > len(self._order):
            return None
        victims = list(islice(filterfalse(protected.__contains__, self._order), n))
        if len(victims) < n:
            return None
        consume(map(self._order.__delitem__, victims))
        return victims

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def keys(self) -> Iterator[PoolKey]:
        return iter(self._order)
