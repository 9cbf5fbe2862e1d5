"""Adaptive Replacement Cache (Megiddo & Modha, FAST 2003) adapted to pinned keys."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Iterator

from kvoffload_sidecar.keys import PoolKey

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
        t1, t2 = self._t1, self._t2
        for key in keys:
            if key in t1:
                del t1[key]
                t2[key] = None
            elif key in t2:
                t2.move_to_end(key)

    def evict(self, n: int, protected: Container[PoolKey]) -> list[PoolKey] | None:
        if n <= 0:
            return []
        if n > len(self._t1) + len(self._t2):
            return None
        # Plan without changing anything, so a failure leaves the policy as it was.
        cand1 = (k for k in self._t1 if k not in protected)
        cand2 = (k for k in self._t2 if k not in protected)
        next1, next2 = next(cand1, None), next(cand2, None)
        t1_len = len(self._t1)
        from_t1: list[PoolKey] = []
        from_t2: list[PoolKey] = []
        for _ in range(n):
            if next1 is None and next2 is None:
                return None
            if next1 is not None and (t1_len > self.p or next2 is None):
                from_t1.append(next1)
                t1_len -= 1
                next1 = next(cand1, None)
            else:
                assert next2 is not None
                from_t2.append(next2)
                next2 = next(cand2, None)
        for key in from_t1:
            del self._t1[key]
            self._b1[key] = None
        for key in from_t2:
            del self._t2[key]
            self._b2[key] = None
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
