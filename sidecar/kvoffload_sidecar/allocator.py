"""Free slots of one namespace, gated by the pre-fault frontier.

Compact on purpose: host memory must stay within 1.02 x the pool size, so free slots are never
Python objects. Slots below `fresh` that were freed sit in a numpy `uint32` stack (4 bytes each,
its buffer grows with use); slots from `fresh` up to `ready` were never used and are handed out
by counting; slots at or past `ready` are not pre-faulted yet and cannot be allocated.

Batches of more than `VECTOR_MIN` slots come and go as numpy `intp` arrays (the index applies
them with array operations, see index.py); smaller ones as lists, where a Python loop is cheaper
than numpy's per-call overhead.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

__all__ = ["VECTOR_MIN", "FreeSlots", "SlotArray", "as_slot_array"]

VECTOR_MIN = 128
"""Batches with more slots than this use numpy array operations; smaller ones Python loops
(one numpy call costs ~0.3-1 µs hot and several µs with cold caches between RPCs, a loop step
~30-50 ns; at 64 keys the loops answered ~20 µs sooner over gRPC). Tests lower it to cover both
paths."""

SlotArray = np.ndarray  # 1-D, dtype intp: slot ids


def as_slot_array(slots: Sequence[int] | np.ndarray) -> np.ndarray:
    """`slots` as a 1-D intp array: an intp array as it is, a list in one C pass."""
    if isinstance(slots, np.ndarray):
        return slots if slots.dtype == np.intp else slots.astype(np.intp)
    if _INTP_IS_Q:  # list -> array('q') -> zero-copy view: ~3x faster than np.fromiter
        return np.frombuffer(array("q", slots), np.intp)
    return np.fromiter(slots, np.intp, len(slots))


_INTP_IS_Q = np.dtype(np.intp).itemsize == array("q").itemsize


class FreeSlots:
    """LIFO free list (recently freed slots are reused first: their pages are warm)."""

    def __init__(self, slot_count: int) -> None:
        if slot_count < 0:
            raise ValueError(f"slot_count must be >= 0, got {slot_count}")
        self.slot_count = slot_count
        self._freed = np.zeros(0, np.uint32)  # stack buffer; [0, _top) are free slots
        self._top = 0
        self._fresh = 0  # first never-allocated slot
        self._ready = 0  # slots [0, ready) are pre-faulted

    @classmethod
    def adopted(cls, slot_count: int, used: np.ndarray, withheld: np.ndarray) -> FreeSlots:
        """The free list of an adopted namespace: every slot below the highest used or withheld
        one that is neither is free (its pages were faulted in when it was first handed out);
        the ones above are handed out as the pre-fault passes them, as in a new pool."""
        free = cls(slot_count)
        taken = np.concatenate([used, withheld]).astype(np.intp, copy=False)
        if not len(taken):
            return free
        fresh = int(taken.max()) + 1
        mask = np.ones(fresh, bool)
        mask[taken] = False
        gaps = np.flatnonzero(mask)[::-1]  # LIFO: the lowest free slot is handed out first
        free._fresh = fresh
        free._reserve_room(len(gaps))
        free._freed[: len(gaps)] = gaps
        free._top = len(gaps)
        return free

    @property
    def fresh(self) -> int:
        """Slots at or above this were never handed out."""
        return self._fresh

    @property
    def ready(self) -> int:
        """Slots whose bytes are pre-faulted on every rank (allocatable once free)."""
        return self._ready

    def set_ready(self, n: int) -> None:
        """Advance the pre-fault frontier (it never moves back)."""
        self._ready = max(self._ready, min(n, self.slot_count))

    def available(self) -> int:
        """Slots `allocate` can hand out right now."""
        return self._top + self._ready - self._fresh

    def allocate(self) -> int | None:
        """A free, ready slot, or None."""
        if self._top:
            self._top -= 1
            return int(self._freed[self._top])
        if self._fresh < self._ready:
            self._fresh += 1
            return self._fresh - 1
        return None

    def allocate_many(self, n: int) -> list[int] | np.ndarray:
        """Up to `n` free, ready slots (fewer when fewer are available), in the order n calls of
        `allocate` would hand them out: a list for n <= VECTOR_MIN, else an intp array."""
        if n == 1:  # the common single-key call
            slot = self.allocate()
            return [] if slot is None else [slot]
        top = self._top
        take = min(n, top)
        fresh = max(0, min(n - take, self._ready - self._fresh))
        if n <= VECTOR_MIN:
            out: list[int] = self._freed[top - take : top][::-1].tolist() if take else []
            if fresh:
                out.extend(range(self._fresh, self._fresh + fresh))
                self._fresh += fresh
            self._top = top - take
            return out
        parts = []
        if take:
            # LIFO, like `allocate`: the top of the stack first
            parts.append(self._freed[top - take : top][::-1].astype(np.intp))
            self._top = top - take
        if fresh:
            parts.append(np.arange(self._fresh, self._fresh + fresh, dtype=np.intp))
            self._fresh += fresh
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.zeros(0, np.intp)

    def mark(self) -> tuple[int, int]:
        """The allocation state, for `rewind`."""
        return self._top, self._fresh

    def rewind(self, mark: tuple[int, int]) -> None:
        """Undo the allocations since `mark` (nothing may have been released since: allocating
        only moves the stack top and the fresh counter, the stack's contents stay)."""
        self._top, self._fresh = mark

    def release(self, slot: int) -> None:
        """Give back a slot taken by `allocate` (the index guarantees it is not free already)."""
        if not 0 <= slot < self._fresh:
            raise ValueError(f"slot {slot} was never allocated")
        self._reserve_room(1)
        self._freed[self._top] = slot
        self._top += 1

    def release_many(self, slots: Sequence[int] | np.ndarray) -> None:
        """`release` for each slot in order; all or nothing (ValueError before any is taken)."""
        n = len(slots)
        if n <= 1:  # the common single-key call
            if n:
                self.release(slots[0])
            return
        if isinstance(slots, np.ndarray):
            if slots.min() < 0 or slots.max() >= self._fresh:
                bad = int(slots[(slots < 0) | (slots >= self._fresh)][0])
                raise ValueError(f"slot {bad} was never allocated")
        elif min(slots) < 0 or max(slots) >= self._fresh:
            bad = next(s for s in slots if not 0 <= s < self._fresh)
            raise ValueError(f"slot {bad} was never allocated")
        self._reserve_room(n)
        self._freed[self._top : self._top + n] = slots
        self._top += n

    def _reserve_room(self, n: int) -> None:
        """Grow the stack buffer (doubling, at most one entry per slot) to hold n more."""
        need = self._top + n
        size = len(self._freed)
        if need <= size:
            return
        grown = np.zeros(min(max(need, 2 * size, 1024), max(self.slot_count, need)), np.uint32)
        grown[: self._top] = self._freed[: self._top]
        self._freed = grown

    def free_slots(self) -> set[int]:
        """Every free slot, ready or not (for invariant checks; O(slot_count))."""
        return set(self._freed[: self._top].tolist()) | set(range(self._fresh, self.slot_count))

    def freed_count(self) -> int:
        """Length of the freed stack (for invariant checks)."""
        return self._top

    def nbytes(self) -> int:
        """Bytes of the free stack's buffer."""
        return int(self._freed.nbytes)
