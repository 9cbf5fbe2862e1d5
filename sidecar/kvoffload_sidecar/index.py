"""Slot state of one namespace: key <-> slot, FREE/RESERVED/COMMITTED, pins, store reservations.

Mechanics only: no eviction choice (that is the policy's) and no free list (the allocator's).
Per-slot state lives in compact arrays that grow with the highest slot ever used, so a large,
mostly empty pool costs almost nothing; only live keys are dict entries.

Lifecycle of a slot:
    FREE --reserve--> RESERVED(store) --commit by every rank--> COMMITTED (visible)
    COMMITTED --pin--> pinned (n > 0; never evicted) --unpin--> COMMITTED
    RESERVED --abort--> FREE;  COMMITTED and unpinned --evict--> FREE
"""

from __future__ import annotations

import enum
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvoffload_sidecar.errors import InvalidArgument, NotFound
from kvoffload_sidecar.keys import PoolKey

__all__ = ["PinRecord", "SlotIndex", "SlotState", "StoreRecord"]

_RECENT_STORES = 4096  # completed store ids remembered so a retried commit stays idempotent


class SlotState(enum.IntEnum):
    FREE = 0
    RESERVED = 1
    COMMITTED = 2


@dataclass(slots=True)
class StoreRecord:
    """An open store reservation: its slots become visible when every rank has committed."""

    store_id: int
    client_id: int
    slots: array  # array('I'), key order
    committed_ranks: int = 0  # bitmask of ranks that committed


@dataclass(slots=True)
class PinRecord:
    """Slots pinned for reading by one ReserveLoad."""

    pin_id: int
    client_id: int
    slots: tuple[int, ...]


@dataclass(slots=True)
class _Counts:
    reserved: int = 0
    committed: int = 0
    pinned: int = 0  # slots with a pin count > 0


class SlotIndex:
    """The slot table of one namespace; every method assumes the pool's lock is held."""

    def __init__(self, slot_count: int, num_ranks: int) -> None:
        if slot_count < 1 or num_ranks < 1:
            raise ValueError(f"slot_count and num_ranks must be >= 1: {slot_count}, {num_ranks}")
        self.slot_count = slot_count
        self.num_ranks = num_ranks
        self._all_ranks = (1 << num_ranks) - 1
        self._slot_of: dict[PoolKey, int] = {}
        self._key_of: list[PoolKey | None] = []
        self._state = bytearray()
        self._pins = array("I")
        self.stores: dict[int, StoreRecord] = {}
        self.pin_records: dict[int, PinRecord] = {}
        self._recent_done: OrderedDict[int, None] = OrderedDict()
        self.counts = _Counts()

    # -- queries ------------------------------------------------------------------------------

    def find(self, key: PoolKey) -> int | None:
        """The slot holding `key` (reserved or committed), or None."""
        return self._slot_of.get(key)

    def state(self, slot: int) -> SlotState:
        return SlotState(self._state[slot]) if slot < len(self._state) else SlotState.FREE

    def pin_count(self, slot: int) -> int:
        return self._pins[slot] if slot < len(self._pins) else 0

    def key_at(self, slot: int) -> PoolKey | None:
        return self._key_of[slot] if slot < len(self._key_of) else None

    def committed_prefix(self, keys: Sequence[PoolKey]) -> list[int]:
        """Slots of the longest prefix of `keys` that is committed (visible)."""
        slots: list[int] = []
        slot_of, state = self._slot_of, self._state
        committed = SlotState.COMMITTED
        for key in keys:
            slot = slot_of.get(key)
            if slot is None or state[slot] != committed:
                break
            slots.append(slot)
        return slots

    def is_pinned_key(self, key: object) -> bool:
        slot = self._slot_of.get(key)  # type: ignore[call-overload]
        return slot is not None and self._pins[slot] > 0

    def live_keys(self) -> int:
        return len(self._slot_of)

    # -- transitions --------------------------------------------------------------------------

    def _ensure(self, slot: int) -> None:
        n = len(self._state)
        if slot < n:
            return
        if not 0 <= slot < self.slot_count:
            raise ValueError(f"slot {slot} out of range 0..{self.slot_count - 1}")
        grow = min(max(slot + 1 - n, n, 1024), self.slot_count - n)
        self._state.extend(bytes(grow))
        self._pins.frombytes(bytes(4 * grow))
        self._key_of.extend([None] * grow)

    def reserve(self, key: PoolKey, slot: int) -> None:
        """FREE -> RESERVED for `key` (the caller makes sure neither is in use)."""
        self._ensure(slot)
        if self._state[slot] != SlotState.FREE or key in self._slot_of:
            raise ValueError(f"slot {slot} or its key is already in use")
        self._state[slot] = SlotState.RESERVED
        self._key_of[slot] = key
        self._slot_of[key] = slot
        self.counts.reserved += 1

    def open_store(self, store_id: int, client_id: int, slots: Sequence[int]) -> StoreRecord:
        record = StoreRecord(store_id, client_id, array("I", slots))
        self.stores[store_id] = record
        return record

    def commit_rank(self, store_id: int, rank: int) -> list[PoolKey] | None:
        """Record `rank`'s commit. Returns the keys that just became visible when this was the
        last rank, [] for a repeat of an already completed store, None while ranks are missing."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.num_ranks:
            raise InvalidArgument(f"rank {rank!r} out of range 0..{self.num_ranks - 1}")
        record = self.stores.get(store_id)
        if record is None:
            if store_id in self._recent_done:
                return []
            raise NotFound(f"unknown store id {store_id} (never reserved, aborted or expired)")
        record.committed_ranks |= 1 << rank
        if record.committed_ranks != self._all_ranks:
            return None
        keys: list[PoolKey] = []
        state, key_of = self._state, self._key_of
        for slot in record.slots:
            state[slot] = SlotState.COMMITTED
            keys.append(key_of[slot])  # type: ignore[arg-type]
        n = len(record.slots)
        self.counts.reserved -= n
        self.counts.committed += n
        del self.stores[store_id]
        self._recent_done[store_id] = None
        if len(self._recent_done) > _RECENT_STORES:
            self._recent_done.popitem(last=False)
        return keys

    def abort_store(self, store_id: int) -> list[int]:
        """Free every slot of an open store; returns them (NotFound when not open)."""
        record = self.stores.pop(store_id, None)
        if record is None:
            raise NotFound(f"unknown store id {store_id} (never reserved, committed or aborted)")
        for slot in record.slots:
            self._free(slot)
        self.counts.reserved -= len(record.slots)
        return list(record.slots)

    def evict(self, key: PoolKey) -> int:
        """COMMITTED, unpinned -> FREE; returns the slot."""
        slot = self._slot_of.get(key)
        if slot is None or self._state[slot] != SlotState.COMMITTED or self._pins[slot]:
            raise ValueError(f"key {key.hex()} is not an unpinned committed slot")
        self._free(slot)
        self.counts.committed -= 1
        return slot

    def _free(self, slot: int) -> None:
        key = self._key_of[slot]
        self._key_of[slot] = None
        self._state[slot] = SlotState.FREE
        del self._slot_of[key]  # type: ignore[arg-type]

    def pin(self, pin_id: int, client_id: int, slots: Sequence[int]) -> PinRecord:
        """Pin committed slots (a slot may be pinned by several records)."""
        pins, counts = self._pins, self.counts
        for slot in slots:
            if self._state[slot] != SlotState.COMMITTED:
                raise ValueError(f"slot {slot} is not committed")
        for slot in slots:
            if pins[slot] == 0:
                counts.pinned += 1
            pins[slot] += 1
        record = PinRecord(pin_id, client_id, tuple(slots))
        self.pin_records[pin_id] = record
        return record

    def unpin(self, pin_id: int) -> int:
        """Drop one pin record; returns its slot count (NotFound when unknown)."""
        record = self.pin_records.pop(pin_id, None)
        if record is None:
            raise NotFound(f"unknown pin id {pin_id}")
        pins, counts = self._pins, self.counts
        for slot in record.slots:
            pins[slot] -= 1
            if pins[slot] == 0:
                counts.pinned -= 1
        return len(record.slots)

    # -- invariants ---------------------------------------------------------------------------

    def check(self, free_slots: set[int]) -> None:
        """AssertionError naming the first broken invariant (O(slot_count))."""
        n = self.slot_count
        used = {s for s in range(len(self._state)) if self._state[s] != SlotState.FREE}
        assert not (free_slots & used), f"slots both free and used: {sorted(free_slots & used)[:5]}"
        assert len(free_slots) + len(used) == n, (
            f"slots in no state or twice: free {len(free_slots)} + used {len(used)} != {n}"
        )
        assert len(self._slot_of) == len(used), (
            f"key->slot has {len(self._slot_of)} entries for {len(used)} used slots"
        )
        for key, slot in self._slot_of.items():
            assert self._key_of[slot] == key, f"key->slot and slot->key disagree at slot {slot}"
            assert self._state[slot] != SlotState.FREE, f"key maps to free slot {slot}"
        for s in range(len(self._state)):
            if self._state[s] == SlotState.FREE:
                assert self._key_of[s] is None, f"free slot {s} still names a key"
                assert self._pins[s] == 0, f"free slot {s} is pinned"
        expected = array("I", bytes(4 * len(self._pins)))
        for record in self.pin_records.values():
            for slot in record.slots:
                expected[slot] += 1
        assert expected == self._pins, "pin counts differ from the sum of live pins"
        for s in range(len(self._pins)):
            if self._pins[s]:
                assert self._state[s] == SlotState.COMMITTED, f"pinned slot {s} is not committed"
        reserved = {s for s in used if self._state[s] == SlotState.RESERVED}
        owned: list[int] = [s for r in self.stores.values() for s in r.slots]
        assert len(owned) == len(set(owned)), "a slot belongs to two store reservations"
        assert set(owned) == reserved, "reserved slots and open store reservations differ"
        for record in self.stores.values():
            assert record.committed_ranks != self._all_ranks, (
                f"store {record.store_id} fully committed but still open"
            )
        committed = len(used) - len(reserved)
        assert self.counts.reserved == len(reserved), "reserved count differs from the table"
        assert self.counts.committed == committed, "committed count differs from the table"
        pinned = sum(1 for p in self._pins if p)
        assert self.counts.pinned == pinned, "pinned count differs from the table"

    def committed_keys(self) -> set[PoolKey]:
        return {k for k, s in self._slot_of.items() if self._state[s] == SlotState.COMMITTED}

    def nbytes_estimate(self) -> int:
        """Rough bytes of the per-slot arrays (not the live-key dict)."""
        return len(self._state) + 4 * len(self._pins) + 8 * len(self._key_of)
