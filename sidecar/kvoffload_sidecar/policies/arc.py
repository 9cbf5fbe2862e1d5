"""Adaptive Replacement Cache (Megiddo & Modha, FAST 2003) adapted to pinned keys."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Container, Iterable, Iterator
from itertools import filterfalse, islice

from kvoffload_sidecar.keys import PoolKey
from kvoffload_sidecar.policies.base import consume

__all__ = ["ARCPolicy"]


class ARCPolicy:
    """ARC balances recency against frequency and learns the balance from its own misses.

    Four lists, each an `OrderedDict` from least (front) to most (back) recently used:

    - **T1**: committed keys hit once since they entered (recency).
    - **T2**: committed keys hit at least twice (frequency); a touch moves a key from T1 to T2.
    - **B1**, **B2**: *ghosts*, keys only (no slot), recently evicted from T1 / T2.

    `p` is the target size of T1. A key stored again while its ghost is in B1 means T1 was too
    small: `p` grows; a ghost found in B2 means T2 was too small: `p` shrinks. Either way the
    returning key goes straight to T2. `evict` takes the LRU end of T1 while `len(T1) > p`, else
    of T2, skipping protected (pinned) keys and falling back to the other list when one has no
    unprotected key. Ghosts are bounded: `len(T1) + len(B1) <= c` and `len(B1) + len(B2) <= c`,
    with `c` the namespace's slot count, so the policy never holds more than `2c` keys.
    """

    name = "arc"

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"ARC needs a capacity >= 1, got {capacity}")
        self.capacity = capacity
        self.p = 0.0
        self._t1: OrderedDict[PoolKey, None] = OrderedDict()
        self._t2: OrderedDict[PoolKey, None] = OrderedDict()
        self._b1: OrderedDict[PoolKey, None] = OrderedDict()
        self._b2: OrderedDict[PoolKey, None] = OrderedDict()

    def insert(self, key: PoolKey) -> None:
        b1, b2 = self._b1, self._b2
        if key in b1:
            self.p = min(float(self.capacity), self.p + max(1.0, len(b2) / len(b1)))
            del b1[key]
            self._t2[key] = None
        elif key in b2:
            self.p = max(0.0, self.p - max(1.0, len(b1) / len(b2)))
            del b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._trim_ghosts()

    def remove(self, key: PoolKey) -> None:
        if key in self._t1:
            del self._t1[key]
        else:
            self._t2.pop(key, None)

    def touch(self, keys: Iterable[PoolKey]) -> None:
        keys = keys if type(keys) in (list, tuple) else list(keys)  # iterated twice below
        t1, t2 = self._t1, self._t2
        promoted = t1.keys() & keys  # hit once before: T1 -> T2 (set ops in C)
        if promoted:
            consume(map(t1.__delitem__, promoted))
            t2.update(dict.fromkeys(promoted))
        try:
            # Every touched key is in T2 now; moving them to the back in key order leaves T2
            # exactly as the key-by-key version would.
            consume(map(t2.move_to_end, keys))
        except KeyError:  # some key is not held: redo in order, skipping those (same result)
            for key in keys:
                if key in t2:
                    t2.move_to_end(key)

    def evict(self, n: int, protected: Container[PoolKey]) -> list[PoolKey] | None:
        if n <= 0:
            return []
        if n > len(self._t1) + len(self._t2):
            return None
        # Plan without changing anything, so a failure leaves the policy as it was. While T1 is
        # over its target p, victims come from T1's LRU end, then from T2's; a list that runs
        # out of unprotected keys hands over to the other (whole runs taken with islice).
        skip = protected.__contains__
        cand1, cand2 = filterfalse(skip, self._t1), filterfalse(skip, self._t2)
        over_target = max(0, math.ceil(len(self._t1) - self.p))
        from_t1 = list(islice(cand1, min(n, over_target)))
        from_t2 = list(islice(cand2, n - len(from_t1)))
        if len(from_t1) + len(from_t2) < n:
            from_t1 += islice(cand1, n - len(from_t1) - len(from_t2))
            if len(from_t1) + len(from_t2) < n:
                return None
        consume(map(self._t1.__delitem__, from_t1))
        self._b1.update(dict.fromkeys(from_t1))
        consume(map(self._t2.__delitem__, from_t2))
        self._b2.update(dict.fromkeys(from_t2))
        self._trim_ghosts()
        return from_t1 + from_t2

    def _trim_ghosts(self) -> None:
        c, b1, b2 = self.capacity, self._b1, self._b2
        while b1 and len(self._t1) + len(b1) > c:
            b1.popitem(last=False)
        while len(b1) + len(b2) > c:
            (b2 if len(b2) >= len(b1) else b1).popitem(last=False)

    def ghost_count(self) -> int:
        """Keys remembered in B1 and B2 (bounded by the capacity)."""
        return len(self._b1) + len(self._b2)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def keys(self) -> Iterator[PoolKey]:
        yield from self._t1
        yield from self._t2
