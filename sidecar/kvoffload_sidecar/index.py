"""Slot state of one namespace: key <-> slot, FREE/RESERVED/COMMITTED, pins, store reservations.

Mechanics only: no eviction choice (that is the policy's) and no free list (the allocator's).
Per-slot state lives in compact arrays (state: a bytearray, pin count: array('I'); 5 bytes a
slot, with numpy views of the same memory for batch operations) that grow with the highest slot
ever used, so a large, mostly empty pool costs almost nothing;
only live keys are in the key map (keymap.py: C, or a dict). There is no slot -> key table: a
reserved slot's key is in its store record (which commit and abort read), and eviction goes
from keys (the policy's) to slots.

The pool calls the batched forms once per request: the packed ones (`committed_prefix_packed`,
`pin_prefix_packed`, `reserve_new_packed`) answer from the request's bytes in one key-map pass;
`reserve_many` and `evict_many` take key lists. Every per-slot check and update is one numpy
fancy-index operation on the batch's slot array instead of a Python loop; everything is
checked before anything changes.
Batches of at most `VECTOR_MIN` slots keep the Python loops, cheaper than numpy's per-call
overhead there (see docs/BENCHMARKS.md, "Sidecar index" and "Sidecar RPC").

Lifecycle of a slot:
    FREE --reserve--> RESERVED(store) --commit by every rank--> COMMITTED (visible)
    COMMITTED --pin--> pinned (n > 0; never evicted) --unpin--> COMMITTED
    RESERVED --abort--> FREE;  COMMITTED and unpinned --evict--> FREE
"""

from __future__ import annotations

import enum
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvoffload_sidecar import allocator
from kvoffload_sidecar.allocator import as_slot_array
from kvoffload_sidecar.errors import InvalidArgument, NotFound
from kvoffload_sidecar.keymap import new_keymap
from kvoffload_sidecar.keys import PoolKey, split_keys

__all__ = ["PinRecord", "SlotIndex", "SlotState", "StoreRecord"]

_RECENT_STORES = 4096  # completed store ids remembered so a retried commit stays idempotent


class SlotState(enum.IntEnum):
    FREE = 0
    RESERVED = 1
    COMMITTED = 2


_FREE, _RESERVED, _COMMITTED = 0, 1, 2  # plain ints: cheaper than the enum in numpy calls
_consume = deque(maxlen=0).extend  # run a `map` for its side effects, in C

Slots = list[int] | np.ndarray  # small batches as lists, larger ones as intp arrays


@dataclass(slots=True)
class StoreRecord:
    """An open store reservation: its slots become visible when every rank has committed."""

    store_id: int
    owner: int  # the engine the reservation belongs to (pool.py: outlives its sessions)
    slots: Slots  # key order; an intp array for batches above VECTOR_MIN
    keys: list[PoolKey] | None  # the slots' keys, same order; None until needed when `packed`
    committed_ranks: int = 0  # bitmask of ranks that committed
    packed: bytes = b""  # the keys as the request packed them, cut on first use (after the
    # answer went out: commit, abort or a check)


@dataclass(slots=True)
class PinRecord:
    """Slots pinned for reading by one ReserveLoad."""

    pin_id: int
    client_id: int
    slots: tuple[int, ...] | np.ndarray  # key order (a slot repeats when its key did); the
    # same array as `array` for batches above VECTOR_MIN
    array: np.ndarray | None = None  # `slots` as intp, for batches above VECTOR_MIN
    distinct: bool = True  # no slot repeats in `array` (one fancy-index update is exact)


@dataclass(slots=True)
class _Counts:
    reserved: int = 0
    committed: int = 0
    pinned: int = 0  # slots with a pin count > 0


class SlotIndex:
    """The slot table of one namespace; every method assumes the pool's lock is held."""

    def __init__(
        self,
        slot_count: int,
        num_ranks: int,
        key_size: int | None = None,
        *,
        native: bool | None = None,
    ) -> None:
        """`key_size`: bytes per key (the packed calls need it; None takes keys of any size);
        `native`: the key map's kind (default: native when built and key_size is set,
        keymap.py)."""
        if slot_count < 1 or num_ranks < 1:
            raise ValueError(f"slot_count and num_ranks must be >= 1: {slot_count}, {num_ranks}")
        self.slot_count = slot_count
        self.num_ranks = num_ranks
        self.key_size = key_size
        self._all_ranks = (1 << num_ranks) - 1
        self._slot_of = new_keymap(key_size, native=native)
        self._state = bytearray()  # SlotState per slot (Python scalar access: fast)
        self._pins = array("I")  # live pins per slot
        self._views()
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

    def slots_of(self, keys: Sequence[PoolKey]) -> list[int | None]:
        """Per key, its slot (reserved or committed) or None; one C-level pass."""
        return list(map(self._slot_of.get, keys))

    def is_pinned_key(self, key: object) -> bool:
        slot = self._slot_of.get(key)  # type: ignore[call-overload]
        return slot is not None and self._pins[slot] > 0

    def live_keys(self) -> int:
        return len(self._slot_of)

    def live_keys_packed(self) -> bytes:
        """Every key in the map (reserved or committed), back to back."""
        return b"".join(k for k, _ in self._slot_of.items())

    # -- transitions --------------------------------------------------------------------------

    def _ensure(self, slot: int) -> None:
        """Grow the per-slot arrays to hold `slot` (doubling, capped at slot_count)."""
        n = len(self._state)
        if slot < n:
            return
        if not 0 <= slot < self.slot_count:
            raise ValueError(f"slot {slot} out of range 0..{self.slot_count - 1}")
        size = n + min(max(slot + 1 - n, n, 1024), self.slot_count - n)
        state = bytearray(size)
        state[:n] = self._state
        pins = array("I", bytes(4 * size))
        pins[:n] = self._pins
        self._state, self._pins = state, pins
        self._views()

    def _views(self) -> None:
        """numpy views of the per-slot arrays (the same memory) for whole-batch operations."""
        self._state_v = np.frombuffer(self._state, np.uint8)
        self._pins_v = np.frombuffer(self._pins, np.uint32)

    def reserve(self, key: PoolKey, slot: int) -> None:
        """FREE -> RESERVED for `key` (the caller makes sure neither is in use)."""
        self._ensure(slot)
        if self._state[slot] != _FREE or key in self._slot_of:
            raise ValueError(f"slot {slot} or its key is already in use")
        self._state[slot] = _RESERVED
        self._slot_of[key] = slot
        self.counts.reserved += 1

    def reserve_many(
        self, keys: Sequence[PoolKey], slots: Slots, *, keys_free: bool = False
    ) -> list[int]:
        """`reserve` for each (key, slot) pair; all or nothing. Keys must be distinct and slots
        distinct (the allocator hands out each free slot once); ValueError before any change
        when a key or slot is in use. `keys_free`: the caller has just checked, under the same
        lock, that no key is in the index (skips that check). Returns the slots as a list."""
        n = len(keys)
        if n != len(slots):
            raise ValueError(f"{n} keys for {len(slots)} slots")
        if n <= allocator.VECTOR_MIN and not isinstance(slots, np.ndarray):
            return self._reserve_few(keys, slots)
        if not n:
            return []
        arr = as_slot_array(slots)
        low = int(arr.min())
        if low < 0:
            raise ValueError(f"slot {low} out of range 0..{self.slot_count - 1}")
        self._ensure(int(arr.max()))
        slot_of = self._slot_of
        if not keys_free and any(map(slot_of.__contains__, keys)):
            raise ValueError("a key of the batch is already in use")
        used = self._state_v[arr]
        if used.any():
            raise ValueError(f"slot {int(arr[used.argmax()])} is already in use")
        self._state_v[arr] = _RESERVED
        slot_list: list[int] = arr.tolist()
        _consume(map(slot_of.__setitem__, keys, slot_list))
        self.counts.reserved += n
        return slot_list

    def reserve_new_packed(self, packed: bytes, slots: np.ndarray) -> bool:
        """`reserve_many` for a request's packed keys, expected to be all new and distinct: one
        key-map pass both checks and inserts (no key objects). False, with nothing changed,
        when a key is already in the index or repeats; the caller then takes the general
        path. The slots must be free (fresh from the allocator)."""
        n, rest = divmod(len(packed), self.key_size)
        if rest or n != len(slots) or not n:
            raise ValueError(
                f"{len(packed)} bytes of {self.key_size}-byte keys for {len(slots)} slots"
            )
        low = int(slots.min())
        if low < 0:
            raise ValueError(f"slot {low} out of range 0..{self.slot_count - 1}")
        self._ensure(int(slots.max()))
        used = self._state_v[slots]
        if used.any():
            raise ValueError(f"slot {int(slots[used.argmax()])} is already in use")
        if not self._slot_of.insert_new(packed, np.ascontiguousarray(slots, dtype=np.int64)):
            return False
        self._state_v[slots] = _RESERVED
        self.counts.reserved += n
        return True

    def _reserve_few(self, keys: Sequence[PoolKey], slots: Sequence[int]) -> list[int]:
        """`reserve_many` for a short list: plain loops."""
        if len(slots) <= 1:  # the common single-key call
            if slots:
                self.reserve(keys[0], slots[0])
            return list(slots)
        if min(slots) < 0:
            raise ValueError(f"slot {min(slots)} out of range 0..{self.slot_count - 1}")
        self._ensure(max(slots))
        slot_of, state = self._slot_of, self._state
        if any(map(slot_of.__contains__, keys)):
            raise ValueError("a key of the batch is already in use")
        for slot in slots:
            if state[slot]:
                raise ValueError(f"slot {slot} is already in use")
        for slot in slots:
            state[slot] = _RESERVED
        _consume(map(slot_of.__setitem__, keys, slots))
        self.counts.reserved += len(slots)
        return list(slots)

    def adopt(self, packed: bytes, slots: np.ndarray) -> None:
        """Committed blocks read back from the pool file (distinct keys and slots, the index
        still empty): FREE -> COMMITTED in one pass."""
        n = len(slots)
        if not n:
            return
        self._ensure(int(slots.max()))
        if self._state_v[slots].any() or len(self._slot_of):
            raise ValueError("adopting into an index that is in use")
        slots64 = np.ascontiguousarray(slots, dtype=np.int64)
        if self.key_size is not None and hasattr(self._slot_of, "insert_new"):
            if not self._slot_of.insert_new(packed, slots64):
                raise ValueError("adopted keys repeat")
        else:  # pragma: no cover - an index built without a key size is never adopted
            raise ValueError("adoption needs an index with a key size")
        self._state_v[slots] = _COMMITTED
        self.counts.committed += n

    def open_store(
        self, store_id: int, owner: int, slots: Slots, keys: Sequence[PoolKey]
    ) -> StoreRecord:
        """Record a store of slots reserved for `keys` (same order, as `reserve_many` took
        them); the record owns `slots` and `keys` from now."""
        if len(keys) != len(slots):
            raise ValueError(f"{len(keys)} keys for {len(slots)} slots")
        if not isinstance(slots, np.ndarray):
            slots = list(slots)
            if len(slots) > allocator.VECTOR_MIN:
                slots = as_slot_array(slots)
        record = StoreRecord(store_id, owner, slots, keys if type(keys) is list else list(keys))
        self.stores[store_id] = record
        return record

    def open_store_packed(
        self, store_id: int, owner: int, slots: np.ndarray, packed: bytes
    ) -> StoreRecord:
        """`open_store` for slots reserved by `reserve_new_packed`: the keys stay packed until a
        commit, an abort or a check needs them."""
        record = StoreRecord(store_id, owner, slots, None, packed=packed)
        self.stores[store_id] = record
        return record

    def _keys_of(self, record: StoreRecord) -> list[PoolKey]:
        if record.keys is None:
            record.keys = split_keys(record.packed, self.key_size, max_keys=len(record.packed))
            record.packed = b""
        return record.keys

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
        if isinstance(slots, np.ndarray):
            self._state_v[slots] = _COMMITTED
        else:
            for slot in slots:
                state[slot] = _COMMITTED
        n = len(slots)
        self.counts.reserved -= n
        self.counts.committed += n
        del self.stores[store_id]
        self._recent_done[store_id] = None
        if len(self._recent_done) > _RECENT_STORES:
            self._recent_done.popitem(last=False)
        return self._keys_of(record)

    def abort_store(self, store_id: int) -> Slots:
        """Free every slot of an open store; returns them, in key order (NotFound when not
        open): a list, or an intp array for a batch above VECTOR_MIN."""
        record = self.stores.pop(store_id, None)
        if record is None:
            raise NotFound(f"unknown store id {store_id} (never reserved, committed or aborted)")
        self._free_many(record.slots, self._keys_of(record))
        self.counts.reserved -= len(record.slots)
        return record.slots

    def evict(self, key: PoolKey) -> int:
        """COMMITTED, unpinned -> FREE; returns the slot."""
        slot = self._slot_of.get(key)
        if slot is None or self._state[slot] != _COMMITTED or self._pins[slot]:
            raise ValueError(f"key {key.hex()} is not an unpinned committed slot")
        self._state[slot] = _FREE
        del self._slot_of[key]
        self.counts.committed -= 1
        return slot

    def evict_many(self, keys: Sequence[PoolKey]) -> list[int]:
        """`evict` for each key (distinct); all or nothing. Returns the slots in key order."""
        if len(keys) == 1:
            return [self.evict(keys[0])]
        slots = list(map(self._slot_of.get, keys))
        state, pins = self._state, self._pins
        if len(keys) <= allocator.VECTOR_MIN:
            for key, slot in zip(keys, slots, strict=True):
                if slot is None or state[slot] != _COMMITTED or pins[slot]:
                    raise ValueError(f"key {key.hex()} is not an unpinned committed slot")
            self._free_many(slots, keys)  # type: ignore[arg-type]
        else:
            if None in slots:
                raise ValueError(
                    f"key {keys[slots.index(None)].hex()} is not an unpinned committed slot"
                )
            arr = as_slot_array(slots)  # type: ignore[arg-type]
            bad = (self._state_v[arr] != _COMMITTED) | (self._pins_v[arr] != 0)
            if bad.any():
                raise ValueError(
                    f"key {keys[int(bad.argmax())].hex()} is not an unpinned committed slot"
                )
            self._free_many(arr, keys)
        self.counts.committed -= len(slots)
        return slots  # type: ignore[return-value]

    def _free_many(self, slots: Slots, keys: Sequence[PoolKey]) -> None:
        """Used slots -> FREE; `keys` are their keys, in the same order."""
        _consume(map(self._slot_of.__delitem__, keys))
        state = self._state
        if isinstance(slots, np.ndarray):
            self._state_v[slots] = _FREE
        else:
            for slot in slots:
                state[slot] = _FREE

    def pin(self, pin_id: int, client_id: int, slots: Sequence[int]) -> PinRecord:
        """Pin committed slots (a slot may be pinned by several records)."""
        slots = list(slots)
        state, arr = self._state, None
        if len(slots) <= allocator.VECTOR_MIN:
            for slot in slots:
                if state[slot] != _COMMITTED:
                    raise ValueError(f"slot {slot} is not committed")
        else:
            arr = as_slot_array(slots)
            hidden = self._state_v[arr] != _COMMITTED
            if hidden.any():
                raise ValueError(f"slot {int(arr[hidden.argmax()])} is not committed")
        return self._pin(pin_id, client_id, slots, arr)

    def committed_prefix_packed(self, packed: bytes) -> np.ndarray:
        """Slots (int64) of the longest committed prefix of a request's packed keys: one pass
        of the key map over the request (no key objects), then one state check."""
        arr = np.frombuffer(self._slot_of.prefix(packed), np.int64)
        if self.counts.reserved and len(arr):  # else every mapped key is committed
            hidden = self._state_v[arr] != _COMMITTED
            if hidden.any():
                arr = arr[: int(hidden.argmax())]
        return arr

    def pin_prefix_packed(self, pin_id: int, client_id: int, packed: bytes) -> PinRecord | None:
        """`pin` the slots of `committed_prefix_packed(packed)` in one pass; None (no record)
        when the prefix is empty."""
        arr = self.committed_prefix_packed(packed)
        if not len(arr):
            return None
        if len(arr) <= allocator.VECTOR_MIN:
            return self._pin(pin_id, client_id, arr.tolist(), None)
        return self._pin(pin_id, client_id, arr, arr)

    def _pin(self, pin_id: int, client_id: int, slots: Slots, arr: np.ndarray | None) -> PinRecord:
        pins = self._pins
        if len(slots) <= allocator.VECTOR_MIN:
            newly = 0
            for slot in slots:
                count = pins[slot]
                if not count:
                    newly += 1
                pins[slot] = count + 1
            record = PinRecord(pin_id, client_id, tuple(slots))
        else:
            if arr is None:
                arr = as_slot_array(slots)
            pins = self._pins_v
            before = pins[arr]
            ordered = np.sort(arr)
            distinct = bool((ordered[1:] != ordered[:-1]).all())
            if distinct:  # the keys of a request are distinct: one fancy-index store is exact
                pins[arr] = before + 1
                newly = len(arr) - int(np.count_nonzero(before))
            else:  # a repeated key pins its slot once per occurrence, as the loop does
                np.add.at(pins, arr, 1)
                newly = len(np.unique(arr[before == 0]))
            record = PinRecord(pin_id, client_id, arr, arr.astype(np.intp, copy=False), distinct)
        self.counts.pinned += newly
        self.pin_records[pin_id] = record
        return record

    def unpin(self, pin_id: int) -> int:
        """Drop one pin record; returns its slot count (NotFound when unknown)."""
        record = self.pin_records.pop(pin_id, None)
        if record is None:
            raise NotFound(f"unknown pin id {pin_id}")
        pins, arr = self._pins, record.array
        if arr is None:
            unpinned = 0
            for slot in record.slots:
                count = pins[slot] - 1
                pins[slot] = count
                if not count:
                    unpinned += 1
        elif record.distinct:
            pins = self._pins_v
            after = pins[arr] - 1
            pins[arr] = after
            unpinned = len(arr) - int(np.count_nonzero(after))
        else:
            pins = self._pins_v
            np.subtract.at(pins, arr, 1)
            unpinned = len(np.unique(arr[pins[arr] == 0]))
        self.counts.pinned -= unpinned
        return len(record.slots)

    # -- invariants ---------------------------------------------------------------------------

    def check(self, free_slots: set[int]) -> None:
        """AssertionError naming the first broken invariant (O(slot_count))."""
        n = self.slot_count
        state, pins, slot_of = self._state_v, self._pins_v, self._slot_of
        assert len(state) == len(pins), "per-slot arrays differ in length"
        used = set(np.flatnonzero(state).tolist())
        assert not (free_slots & used), f"slots both free and used: {sorted(free_slots & used)[:5]}"
        assert len(free_slots) + len(used) == n, (
            f"slots in no state or twice: free {len(free_slots)} + used {len(used)} != {n}"
        )
        assert len(slot_of) == len(used), (
            f"key->slot has {len(slot_of)} entries for {len(used)} used slots"
        )
        mapped = {slot for _, slot in slot_of.items()}
        assert len(mapped) == len(slot_of), "two keys map to one slot"
        stray = mapped - used
        assert not stray, f"key maps to free slot {min(stray, default=0)}"
        free_pinned = np.flatnonzero((state == _FREE) & (pins != 0)).tolist()
        assert not free_pinned, f"free slot {free_pinned[0]} is pinned"
        expected = np.zeros_like(pins)
        for record in self.pin_records.values():
            for slot in record.slots:
                expected[slot] += 1
            if record.array is not None:
                assert record.array.tolist() == _as_list(record.slots), (
                    f"pin {record.pin_id}: slot array differs from its slots"
                )
                ordered = sorted(record.slots)
                distinct = all(a != b for a, b in zip(ordered, ordered[1:], strict=False))
                assert record.distinct == distinct, f"pin {record.pin_id}: wrong distinct flag"
        assert np.array_equal(expected, pins), "pin counts differ from the sum of live pins"
        for s in np.flatnonzero(pins).tolist():
            assert state[s] == _COMMITTED, f"pinned slot {s} is not committed"
        reserved = set(np.flatnonzero(state == _RESERVED).tolist())
        owned: list[int] = [s for r in self.stores.values() for s in _as_list(r.slots)]
        assert len(owned) == len(set(owned)), "a slot belongs to two store reservations"
        assert set(owned) == reserved, "reserved slots and open store reservations differ"
        for record in self.stores.values():
            assert record.committed_ranks != self._all_ranks, (
                f"store {record.store_id} fully committed but still open"
            )
            assert [slot_of.get(k) for k in self._keys_of(record)] == _as_list(record.slots), (
                f"store {record.store_id}: its keys do not map to its slots"
            )
        committed = len(used) - len(reserved)
        assert self.counts.reserved == len(reserved), "reserved count differs from the table"
        assert self.counts.committed == committed, "committed count differs from the table"
        pinned = int(np.count_nonzero(pins))
        assert self.counts.pinned == pinned, "pinned count differs from the table"

    def committed_keys(self) -> set[PoolKey]:
        state = self._state
        return {k for k, s in self._slot_of.items() if state[s] == _COMMITTED}

    def nbytes_estimate(self) -> int:
        """Rough bytes of the per-slot arrays (not the live-key dict)."""
        return len(self._state) + self._pins.itemsize * len(self._pins)


def _as_list(slots: Slots) -> list[int]:
    return slots.tolist() if isinstance(slots, np.ndarray) else list(slots)
