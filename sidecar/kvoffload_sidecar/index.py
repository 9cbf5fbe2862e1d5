"""Slot state of one namespace: key <-> slot, FREE/RESERVED/COMMITTED, pins, store reservations.

Mechanics only: no eviction choice (that is the policy's) and no free list (the allocator's).
Per-slot state lives in compact arrays that grow with the highest slot ever used, so a large,
mostly empty pool costs almost nothing; only live keys are dict entries.

The pool calls the batched forms (`committed_prefix`, `pin_prefix`, `reserve_many`, `evict_many`)
once per request: whole-list passes (`map` over the dict, `dict.update`) instead of a method call
per key, checked before anything changes (see docs/BENCHMARKS.md, "Sidecar index").

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

    def slots_of(self, keys: Sequence[PoolKey]) -> list[int | None]:
        """Per key, its slot (reserved or committed) or None; one C-level pass."""
        return list(map(self._slot_of.get, keys))

    def committed_prefix(self, keys: Sequence[PoolKey]) -> list[int]:
        """Slots of the longest prefix of `keys` that is committed (visible)."""
        slots = list(map(self._slot_of.get, keys))
        if None in slots:  # cheaper than catching index()'s ValueError when all are found
            del slots[slots.index(None) :]
        if self.counts.reserved:  # else every mapped key is committed
            state, committed = self._state, SlotState.COMMITTED
            for i, slot in enumerate(slots):
                if state[slot] != committed:
                    del slots[i:]
                    break
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

    def reserve_many(self, keys: Sequence[PoolKey], slots: Sequence[int]) -> None:
        """`reserve` for each (key, slot) pair; all or nothing. Keys must be distinct and slots
        distinct (the allocator hands out each free slot once); ValueError before any change
        when a key or slot is in use."""
        if len(keys) != len(slots):
            raise ValueError(f"{len(keys)} keys for {len(slots)} slots")
        if len(slots) <= 1:  # the common single-key call
            if slots:
                self.reserve(keys[0], slots[0])
            return
        if min(slots) < 0:
            raise ValueError(f"slot {min(slots)} out of range 0..{self.slot_count - 1}")
        self._ensure(max(slots))
        slot_of, state, key_of = self._slot_of, self._state, self._key_of
        if not slot_of.keys().isdisjoint(keys):
            raise ValueError("a key of the batch is already in use")
        for slot in slots:
            if state[slot]:
                raise ValueError(f"slot {slot} is already in use")
        reserved = SlotState.RESERVED
        for slot, key in zip(slots, keys, strict=True):
            state[slot] = reserved
            key_of[slot] = key
        slot_of.update(zip(keys, slots, strict=True))
        self.counts.reserved += len(slots)

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
        slots, state = record.slots, self._state
        keys: list[PoolKey] = list(map(self._key_of.__getitem__, slots))  # type: ignore[arg-type]
        committed = SlotState.COMMITTED
        for slot in slots:
            state[slot] = committed
        n = len(slots)
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
        slots = record.slots.tolist()
        self._free_many(slots)
        self.counts.reserved -= len(slots)
        return slots

    def evict(self, key: PoolKey) -> int:
        """COMMITTED, unpinned -> FREE; returns the slot."""
        slot = self._slot_of.get(key)
        if slot is None or self._state[slot] != SlotState.COMMITTED or self._pins[slot]:
            raise ValueError(f"key {key.hex()} is not an unpinned committed slot")
        self._free(slot)
        self.counts.committed -= 1
        return slot

    def evict_many(self, keys: Sequence[PoolKey]) -> list[int]:
        """`evict` for each key (distinct); all or nothing. Returns the slots in key order."""
        if len(keys) == 1:
            return [self.evict(keys[0])]
        slot_of = self._slot_of
        slots = list(map(slot_of.get, keys))
        state, pins, committed = self._state, self._pins, SlotState.COMMITTED
        for key, slot in zip(keys, slots, strict=True):
            if slot is None or state[slot] != committed or pins[slot]:
                raise ValueError(f"key {key.hex()} is not an unpinned committed slot")
        self._free_many(slots)  # type: ignore[arg-type]
        self.counts.committed -= len(slots)
        return slots  # type: ignore[return-value]

    def _free_many(self, slots: Sequence[int]) -> None:
        state, key_of, free = self._state, self._key_of, SlotState.FREE
        slot_of = self._slot_of
        for slot in slots:
            del slot_of[key_of[slot]]  # type: ignore[arg-type]
            key_of[slot] = None
            state[slot] = free

    def _free(self, slot: int) -> None:
        key = self._key_of[slot]
        self._key_of[slot] = None
        self._state[slot] = SlotState.FREE
        del self._slot_of[key]  # type: ignore[arg-type]

    def pin(self, pin_id: int, client_id: int, slots: Sequence[int]) -> PinRecord:
        """Pin committed slots (a slot may be pinned by several records)."""
        state, committed = self._state, SlotState.COMMITTED
        for slot in slots:
            if state[slot] != committed:
                raise ValueError(f"slot {slot} is not committed")
        return self._pin(pin_id, client_id, tuple(slots))

    def pin_prefix(self, pin_id: int, client_id: int, keys: Sequence[PoolKey]) -> PinRecord | None:
        """`pin` the slots of `committed_prefix(keys)` in one pass; None (no record) when the
        prefix is empty."""
        slots = self.committed_prefix(keys)
        return self._pin(pin_id, client_id, tuple(slots)) if slots else None

    def _pin(self, pin_id: int, client_id: int, slots: tuple[int, ...]) -> PinRecord:
        pins, newly = self._pins, 0
        for slot in slots:
            count = pins[slot]
            if not count:
                newly += 1
            pins[slot] = count + 1
        self.counts.pinned += newly
        record = PinRecord(pin_id, client_id, slots)
        self.pin_records[pin_id] = record
        return record

    def unpin(self, pin_id: int) -> int:
        """Drop one pin record; returns its slot count (NotFound when unknown)."""
        record = self.pin_records.pop(pin_id, None)
        if record is None:
            raise NotFound(f"unknown pin id {pin_id}")
        pins, unpinned = self._pins, 0
        for slot in record.slots:
            count = pins[slot] - 1
            pins[slot] = count
            if not count:
                unpinned += 1
        self.counts.pinned -= unpinned
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
