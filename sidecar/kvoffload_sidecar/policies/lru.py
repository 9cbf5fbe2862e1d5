"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Iterator

from kvoffload_sidecar.keys import PoolKey

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
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: PoolKey) -> None:
        self._order.pop(key, None)

    def touch(self, keys: Iterable[PoolKey]) -> None:
        order = self._order
        for key in keys:
            if key in order:
                order.move_to_end(key)

    def evict(self, n: int, protected: Container[PoolKey]) -> list[PoolKey] | None:
        if n <= 0:
            return []
        if n > len(self._order):
            return None
        victims: list[PoolKey] = []
        for key in self._order:
            if key not in protected:
                victims.append(key)
                if len(victims) == n:
                    break
        if len(victims) < n:
            return None
        for key in victims:
            del self._order[key]
        return victims

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def keys(self) -> Iterator[PoolKey]:
        return iter(self._order)
