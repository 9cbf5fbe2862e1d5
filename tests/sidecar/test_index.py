"""Slot table and free list on their own, and the invariant checker catching corruption."""

from __future__ import annotations

import pytest
from kvoffload_sidecar import keymap
from kvoffload_sidecar.allocator import FreeSlots
from kvoffload_sidecar.errors import InvalidArgument, NotFound
from kvoffload_sidecar.index import SlotIndex, SlotState
from pool_invariants import check_invariants

MiB = 1 << 20


def k(i: int) -> bytes:
    return i.to_bytes(8, "big")


def test_free_slots_are_gated_by_the_prefault_frontier():
    free = FreeSlots(4)
    assert free.available() == 0 and free.allocate() is None  # nothing pre-faulted yet
    free.set_ready(2)
    assert [free.allocate(), free.allocate(), free.allocate()] == [0, 1, None]
    free.set_ready(1)  # the frontier never moves back
    assert free.ready == 2
    free.set_ready(99)  # capped at the slot count
    assert free.ready == 4 and free.available() == 2
    free.release(0)
    assert free.allocate() == 0  # freed slots are reused first (warm pages)
    assert free.free_slots() == {2, 3}
    with pytest.raises(ValueError, match="never allocated"):
        free.release(3)


NATIVE = [False, True] if keymap.NativeKeyMap is not None else [False]


@pytest.mark.parametrize("native", NATIVE, ids=lambda n: "native" if n else "dict")
@pytest.mark.parametrize(
    "batch",
    [
        [k(10), k(11), k(1), k(12)],  # one key already in the index
        [k(10), k(11), k(10), k(12)],  # one key twice in the batch
        [k(1), k(2), k(1), k(2)],  # nothing new at all
    ],
)
def test_reserve_new_packed_refuses_known_or_repeated_keys_and_changes_nothing(batch, native):
    import numpy as np

    index = SlotIndex(slot_count=16, num_ranks=1, key_size=8, native=native)
    index.reserve_many([k(1), k(2)], [0, 1])
    index.open_store(1, owner=1, slots=[0, 1], keys=[k(1), k(2)])
    before = (dict(index._slot_of.items()), bytes(index._state), index.counts.reserved)
    assert index.reserve_new_packed(b"".join(batch), np.arange(4, 8)) is False
    assert (dict(index._slot_of.items()), bytes(index._state), index.counts.reserved) == before
    index.check(free_slots=set(range(2, 16)))
    fresh = [k(20), k(21), k(22), k(23)]
    assert index.reserve_new_packed(b"".join(fresh), np.arange(4, 8)) is True
    assert [index.find(x) for x in fresh] == [4, 5, 6, 7]
    assert index.state(5) == SlotState.RESERVED and index.counts.reserved == 6
    index.open_store_packed(2, owner=1, slots=np.arange(4, 8), packed=b"".join(fresh))
    index.check(free_slots=set(range(2, 4)) | set(range(8, 16)))
    assert index.commit_rank(2, 0) == fresh  # the packed keys are cut when the commit needs them
    assert list(index.committed_prefix_packed(b"".join([k(20), k(21), k(9), k(22)]))) == [4, 5]


def test_slot_lifecycle_and_counts():
    index = SlotIndex(slot_count=8, num_ranks=2, key_size=8)
    index.reserve(k(1), 0)
    index.reserve(k(2), 1)
    index.open_store(7, owner=1, slots=[0, 1], keys=[k(1), k(2)])
    assert index.state(0) == SlotState.RESERVED and index.find(k(1)) == 0
    assert list(index.committed_prefix_packed(k(1) + k(2))) == []  # reserved is invisible
    assert index.commit_rank(7, 1) is None  # rank 0 still missing
    assert index.commit_rank(7, 0) == [k(1), k(2)]
    assert index.commit_rank(7, 0) == []  # a repeat of a completed store
    assert list(index.committed_prefix_packed(k(1) + k(2) + k(3))) == [0, 1]
    index.pin(1, client_id=1, slots=[0])
    index.pin(2, client_id=2, slots=[0, 1])
    assert (index.pin_count(0), index.counts.pinned) == (2, 2)
    with pytest.raises(ValueError, match="not an unpinned committed slot"):
        index.evict(k(1))
    assert index.unpin(2) == 2 and index.counts.pinned == 1
    assert index.evict(k(2)) == 1 and index.state(1) == SlotState.FREE
    assert (index.counts.committed, index.counts.reserved) == (1, 0)
    index.check(free_slots=set(range(1, 8)))


def test_abort_and_unknown_ids():
    index = SlotIndex(slot_count=4, num_ranks=1)
    index.reserve(k(5), 3)
    index.open_store(9, owner=1, slots=[3], keys=[k(5)])
    with pytest.raises(InvalidArgument, match="rank 1 out of range"):
        index.commit_rank(9, 1)
    assert index.abort_store(9) == [3]
    assert index.find(k(5)) is None and index.state(3) == SlotState.FREE
    with pytest.raises(NotFound):
        index.abort_store(9)
    with pytest.raises(NotFound):
        index.commit_rank(9, 0)
    with pytest.raises(NotFound):
        index.unpin(1)
    index.check(free_slots={0, 1, 2, 3})


def test_per_slot_arrays_grow_with_use_not_with_capacity():
    index = SlotIndex(slot_count=50_000_000, num_ranks=1)
    assert index.nbytes_estimate() == 0
    index.reserve(k(1), 0)
    assert index.nbytes_estimate() < 64 * 1024  # one growth step, not 50M slots


@pytest.mark.parametrize(
    "corrupt,message",
    [
        (lambda ix: ix._pins.__setitem__(0, 3), "pin counts"),
        (lambda ix: ix._slot_of.__setitem__(k(99), 1), "key->slot"),
        (lambda ix: ix._slot_of.__setitem__(k(1), 1), "two keys map to one slot"),
        (lambda ix: ix.stores[2].keys.__setitem__(0, k(1)), "keys do not map to its slots"),
        (lambda ix: ix.stores.clear(), "reserved slots and open store"),
        (lambda ix: setattr(ix.counts, "committed", 5), "committed count"),
    ],
)
def test_check_names_the_broken_invariant(corrupt, message):
    index = SlotIndex(slot_count=4, num_ranks=1)
    index.reserve(k(1), 0)
    index.open_store(1, owner=1, slots=[0], keys=[k(1)])
    index.commit_rank(1, 0)
    index.reserve(k(2), 1)
    index.open_store(2, owner=1, slots=[1], keys=[k(2)])
    index.check(free_slots={2, 3})
    corrupt(index)
    with pytest.raises(AssertionError, match=message):
        index.check(free_slots={2, 3})


def test_check_catches_a_slot_both_free_and_used():
    index = SlotIndex(slot_count=4, num_ranks=1)
    index.reserve(k(1), 0)
    index.open_store(1, owner=1, slots=[0], keys=[k(1)])
    with pytest.raises(AssertionError, match="both free and used"):
        index.check(free_slots={0, 1, 2, 3})


def test_pool_check_catches_policy_drift(make_pool, small_spec, make_keys):
    pool = make_pool()
    reg = pool.register(small_spec(), 1, MiB, "x")
    res = pool.reserve_store(reg.namespace_id, reg.client_id, make_keys([1, 2]))
    pool.commit_store(reg.namespace_id, res.store_id, 0)
    check_invariants(pool)
    ns = pool._namespaces[reg.namespace_id]
    ns.policy.remove(k(1))  # the policy forgot a committed key
    with pytest.raises(AssertionError, match="policy holds 1 keys, 2 are committed"):
        check_invariants(pool)
