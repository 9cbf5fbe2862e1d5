"""The eviction-policy protocol.

Mechanics and policy are split: the index owns slot states, pins and the free list; a policy owns
only the ordering data of the *committed* keys of one namespace and picks victims. The pool calls
a policy with its lock held; policies are not thread-safe themselves.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Container, Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

from kvoffload_sidecar.keys import PoolKey

__all__ = ["CachePolicy", "consume"]

consume: Callable[[Iterable[Any]], None] = deque(maxlen=0).extend
"""Run an iterator to its end, keeping nothing: `consume(map(d.move_to_end, keys))` does a
per-key method call in C, about twice as fast as the same Python `for` loop."""


@runtime_checkable
class CachePolicy(Protocol):
    """Orders the committed keys of one namespace and chooses eviction victims.

    Contract: the policy holds exactly the keys given to `insert` and not yet removed by `remove`
    or returned by `evict`. Keys the pool must keep (pinned) are passed as `protected`.
    """

    name: str

    def insert(self, key: PoolKey) -> None:
        """A key became visible (every rank committed). It must not be held already."""

    def remove(self, key: PoolKey) -> None:
        """Forget a held key without counting it as an eviction (no-op if not held)."""

    def touch(self, keys: Iterable[PoolKey]) -> None:
        """The keys were hit (lookup/load); keys not held are ignored."""

    def evict(self, n: int, protected: Container[PoolKey]) -> list[PoolKey] | None:
        """Remove and return `n` victims not in `protected`, or return None and change nothing
        when fewer than `n` unprotected keys are held (atomic)."""

    def __len__(self) -> int:
        """Number of held keys."""

    def __contains__(self, key: object) -> bool:
        """Whether `key` is held."""

    def keys(self) -> Iterator[PoolKey]:
        """Every held key (any order); for invariant checks."""
