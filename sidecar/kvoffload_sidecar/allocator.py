"""Free slots of one namespace, gated by the pre-fault frontier.

Compact on purpose: host memory must stay within 1.02 x the pool size, so free slots are never
Python objects. Slots below `fresh` that were freed sit in an `array('I')` stack; slots from `fresh`
up to `ready` were never used and are handed out by counting; slots at or past `ready` are not
pre-faulted yet and cannot be allocated.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

__all__ = ["FreeSlots"]


class FreeSlots:
    """LIFO free list (recently freed slots are reused first: their pages are warm)."""

    def __init__(self, slot_count: int) -> None:
        if slot_count < 0:
            raise ValueError(f"slot_count must be >= 0, got {slot_count}")
        self.slot_count = slot_count
        self._freed = array("I")
        self._fresh = 0  # first never-allocated slot
        self._ready = 0  # slots [0, ready) are pre-faulted

    @property
    def ready(self) -> int:
        """Slots whose bytes are pre-faulted on every rank (allocatable once free)."""
        return self._ready

    def set_ready(self, n: int) -> None:
        """Advance the pre-fault frontier (it never moves back)."""
        self._ready = max(self._ready, min(n, self.slot_count))

    def available(self) -> int:
        """Slots `allocate` can hand out right now."""
        return len(self._freed) + self._ready - self._fresh

    def allocate(self) -> int | None:
        """A free, ready slot, or None."""
        if self._freed:
            return self._freed.pop()
        if self._fresh < self._ready:
            self._fresh += 1
            return self._fresh - 1
        return None

    def allocate_many(self, n: int) -> list[int]:
        """Up to `n` free, ready slots (fewer when fewer are available), in the order n calls of
        `allocate` would hand them out."""
        if n == 1:  # the common single-key call: skip the slicing
            slot = self.allocate()
            return [] if slot is None else [slot]
        freed = self._freed
        take = min(n, len(freed))
        out: list[int] = []
        if take:
            cut = len(freed) - take
            out = freed[cut:].tolist()
            out.reverse()  # LIFO, like `allocate`
            del freed[cut:]
        fresh = min(n - take, self._ready - self._fresh)
        if fresh > 0:
            out.extend(range(self._fresh, self._fresh + fresh))
            self._fresh += fresh
        return out

    def release(self, slot: int) -> None:
        """Give back a slot taken by `allocate` (the index guarantees it is not free already)."""
        if not 0 <= slot < self._fresh:
            raise ValueError(f"slot {slot} was never allocated")
        self._freed.append(slot)

    def release_many(self, slots: Sequence[int]) -> None:
        """`release` for each slot in order; all or nothing (ValueError before any is taken)."""
        if len(slots) <= 1:
            if slots:
                self.release(slots[0])
            return
        if min(slots) < 0 or max(slots) >= self._fresh:
            bad = next(s for s in slots if not 0 <= s < self._fresh)
            raise ValueError(f"slot {bad} was never allocated")
        self._freed.extend(slots)

    def free_slots(self) -> set[int]:
        """Every free slot, ready or not (for invariant checks; O(slot_count))."""
        return set(self._freed) | set(range(self._fresh, self.slot_count))

    def freed_count(self) -> int:
        """Length of the freed stack (for invariant checks)."""
        return len(self._freed)

    def nbytes(self) -> int:
        """Bytes of the free stack's buffer."""
        return self._freed.buffer_info()[1] * self._freed.itemsize
