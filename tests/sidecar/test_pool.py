"""The Pool domain API as narrated scenarios (no gRPC), mirroring vLLM's kv_offload tests.

Geometry used throughout unless a test says otherwise: an 8 MiB pool, one partition, slots of
1 MiB per rank, so tp=1 gives 8 slots and tp=2 gives 4 slots per rank.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass

import pytest
from kvoffload_sidecar.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PoolError,
    ResourceExhausted,
    Unavailable,
)
from kvoffload_sidecar.pool import LoadPin, Pool, Registration, StoreDecision
from kvoffload_sidecar.region import PrefaultGate
from pool_invariants import check_invariants

MiB = 1 << 20
NEW, PRESENT, NO_SPACE = StoreDecision.NEW, StoreDecision.PRESENT, StoreDecision.NO_SPACE
POLICIES = ["lru", "arc"]


def pack(*ints: int) -> bytes:
    return b"".join(i.to_bytes(8, "big") for i in ints)


def store(pool: Pool, reg: Registration, *ints: int) -> tuple[StoreDecision, ...]:
    """Reserve the keys and commit every rank: the full happy path of one store."""
    res = pool.reserve_store(reg.namespace_id, reg.client_id, pack(*ints))
    if res.store_id:
        for rank in range(len(reg.regions)):
            pool.commit_store(reg.namespace_id, res.store_id, rank)
    return res.decisions


def hits(pool: Pool, reg: Registration, *ints: int) -> int:
    return pool.lookup(reg.namespace_id, [pack(*ints)])[0]


def ns_stats(pool: Pool, reg: Registration):
    (ns,) = [n for n in pool.stats().namespaces if n.namespace_id == reg.namespace_id]
    return ns


@pytest.fixture(params=POLICIES)
def policy(request) -> str:
    return request.param


@pytest.fixture
def pool(make_pool, policy) -> Pool:
    p = make_pool(eviction=policy)
    assert p.wait_ready(10)
    return p


@pytest.fixture
def reg(pool, small_spec) -> Registration:
    return pool.register(small_spec(), 1, 1 * MiB, "engine-0/scheduler")


# -- registration ------------------------------------------------------------------------------


def test_register_describes_rank_regions_in_the_pool_file(make_pool, small_spec):
    pool = make_pool(pool_size=16 * MiB)
    reg = pool.register(small_spec(tp_size=2), 2, 1 * MiB, "engine-0/rank-0")
    assert reg.client_id > 0 and len(reg.namespace_id) == 32
    # The partition keeps its slot table (and the pool its header) at the end: of 8 MiB a
    # rank, 7 slots remain; rank regions are page aligned, back to back.
    per_rank = reg.regions[1].offset
    assert per_rank % 4096 == 0 and 7 * MiB <= per_rank < 8 * MiB
    assert [(r.rank, r.offset, r.slot_bytes, r.slot_count) for r in reg.regions] == [
        (0, 0, 1 * MiB, 7),
        (1, per_rank, 1 * MiB, 7),
    ]
    assert all(r.path == str(pool.path) for r in reg.regions)
    assert reg.pool_generation == pool.generation and len(reg.pool_generation) == 16
    # A second process of the same engine gets the next client id and the same regions.
    again = pool.register(small_spec(tp_size=2), 2, 1 * MiB, "engine-0/rank-1")
    assert again.client_id == reg.client_id + 1 and again.regions == reg.regions


def test_each_pool_has_its_own_generation(make_pool, tmp_path, small_spec):
    first = make_pool()
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    second = make_pool(pool_dir=other_dir)
    assert first.generation != second.generation


# -- lookup, store, visibility -----------------------------------------------------------------


def test_lookup_returns_longest_committed_prefix(pool, reg):
    # Store blocks 1, 2, 3 (one chain); 4 was never stored.
    assert store(pool, reg, 1, 2, 3) == (NEW, NEW, NEW)
    answers = pool.lookup(reg.namespace_id, [pack(1, 2, 3, 4), pack(2, 3), pack(4, 1), pack()])
    assert answers == [3, 2, 0, 0]
    ns = ns_stats(pool, reg)
    assert (ns.lookups, ns.hit_blocks, ns.miss_blocks) == (4, 5, 2)
    assert (ns.committed_slots, ns.used_bytes) == (3, 3 * MiB)
    check_invariants(pool)


def test_a_pin_that_counts_as_a_lookup_counts_like_one(pool, reg):
    """ReserveLoad with count_lookup (the connector's lookup-and-pin in one round trip)
    counts lookups, hits and misses exactly as Lookup does for the same keys."""
    store(pool, reg, 1, 2, 3)
    pool.attach(reg.client_id)
    plain = pool.reserve_load(reg.namespace_id, reg.client_id, pack(1, 2))
    assert (ns_stats(pool, reg).lookups, ns_stats(pool, reg).hit_blocks) == (0, 0)
    hit = pool.reserve_load(reg.namespace_id, reg.client_id, pack(1, 2, 3, 4), count_lookup=True)
    miss = pool.reserve_load(reg.namespace_id, reg.client_id, pack(4, 1), count_lookup=True)
    assert len(hit.slots) == 3 and miss.pin_id == 0
    ns = ns_stats(pool, reg)
    assert (ns.lookups, ns.hit_blocks, ns.miss_blocks) == (2, 3, 2)
    assert ns.loaded_blocks == 2 + 3
    pool.release(reg.namespace_id, reg.client_id, [plain.pin_id, hit.pin_id])
    check_invariants(pool)


def test_store_is_visible_only_after_every_rank_committed(make_pool, small_spec, policy):
    pool = make_pool(eviction=policy)
    reg = pool.register(small_spec(tp_size=2), 2, 1 * MiB, "sched")
    ns = reg.namespace_id
    res = pool.reserve_store(ns, reg.client_id, pack(1, 2))
    assert res.decisions == (NEW, NEW) and len(set(res.slots)) == 2 and res.store_id > 0
    assert hits(pool, reg, 1, 2) == 0  # reserved, not visible
    assert pool.commit_store(ns, res.store_id, 0) is False
    assert pool.commit_store(ns, res.store_id, 0) is False  # repeated rank: harmless
    assert hits(pool, reg, 1, 2) == 0  # rank 1 has not written yet
    assert ns_stats(pool, reg).reserved_slots == 2
    assert pool.commit_store(ns, res.store_id, 1) is True
    assert hits(pool, reg, 1, 2) == 2
    assert pool.commit_store(ns, res.store_id, 1) is True  # a retried last commit stays True
    with pytest.raises(InvalidArgument, match="rank 2 out of range"):
        pool.commit_store(ns, res.store_id, 2)
    stats = ns_stats(pool, reg)
    assert (stats.stored_blocks, stats.stored_bytes, stats.reserved_slots) == (2, 4 * MiB, 0)
    check_invariants(pool)


def test_reserve_store_answers_present_for_committed_and_in_flight_keys(pool, reg):
    first = pool.reserve_store(reg.namespace_id, reg.client_id, pack(1))
    assert first.decisions == (NEW,)
    # 1 is being stored by someone else: skip it; 2 is new.
    second = pool.reserve_store(reg.namespace_id, reg.client_id, pack(1, 2))
    assert second.decisions == (PRESENT, NEW) and len(second.slots) == 1
    assert second.slots[0] != first.slots[0]
    # The same key twice in one call is stored once.
    third = pool.reserve_store(reg.namespace_id, reg.client_id, pack(3, 3))
    assert third.decisions == (NEW, PRESENT) and len(third.slots) == 1
    pool.commit_store(reg.namespace_id, first.store_id, 0)
    assert pool.reserve_store(reg.namespace_id, reg.client_id, pack(1)).decisions == (PRESENT,)
    nothing = pool.reserve_store(reg.namespace_id, reg.client_id, pack(1))
    assert (nothing.store_id, nothing.slots) == (0, ())
    check_invariants(pool)


# -- eviction and pins -------------------------------------------------------------------------


def test_full_pool_evicts_the_policy_victim(pool, reg):
    assert store(pool, reg, *range(8)) == (NEW,) * 8  # all 8 slots committed
    assert hits(pool, reg, 0) == 1  # 0 is used again
    assert store(pool, reg, 8) == (NEW,)
    # Both policies drop 1: the least recently used, and in ARC the oldest once-used key.
    assert hits(pool, reg, 1) == 0
    assert pool.lookup(reg.namespace_id, [pack(0), pack(8), pack(2, 3, 4, 5, 6, 7)]) == [1, 1, 6]
    assert ns_stats(pool, reg).evicted_blocks == 1
    check_invariants(pool)


def test_a_reported_miss_counts_without_touching_what_it_names(pool, reg):
    """count_misses (the connector's presence-map misses, reported later) counts a lookup
    that found nothing and leaves the eviction order alone: 0 stays the victim."""
    assert store(pool, reg, *range(8)) == (NEW,) * 8
    before = ns_stats(pool, reg)
    assert pool.count_misses(reg.namespace_id, [pack(0, 1), pack(2)]) == [0, 0]
    after = ns_stats(pool, reg)
    assert after.hit_blocks == before.hit_blocks
    assert (after.lookups, after.queried_blocks, after.miss_blocks) == (
        before.lookups + 2,
        before.queried_blocks + 3,
        before.miss_blocks + 2,
    )
    assert store(pool, reg, 8) == (NEW,)
    assert hits(pool, reg, 0) == 0  # a lookup would have made 1 the victim instead
    check_invariants(pool)


def test_pins_survive_eviction_pressure(pool, reg):
    store(pool, reg, *range(8))
    pin = pool.reserve_load(reg.namespace_id, reg.client_id, pack(0, 1, 2, 3, 99, 4))
    assert pin.pin_id > 0 and len(pin.slots) == 4  # the prefix before the miss at 99
    # Eight new blocks arrive: only the four unpinned slots can be recycled.
    decisions = store(pool, reg, *range(10, 18))
    assert decisions == (NEW,) * 4 + (NO_SPACE,) * 4
    assert hits(pool, reg, 0, 1, 2, 3) == 4
    assert pool.reserve_load(reg.namespace_id, reg.client_id, pack(0)).slots == (pin.slots[0],)
    stats = ns_stats(pool, reg)
    assert (stats.pinned_slots, stats.pinned_bytes, stats.loaded_blocks) == (4, 4 * MiB, 5)
    check_invariants(pool)
    # Released, the old blocks are ordinary victims again.
    assert pool.release(reg.namespace_id, reg.client_id, [pin.pin_id]) == 4
    assert ns_stats(pool, reg).pinned_slots == 1  # the second load still pins block 0
    assert store(pool, reg, 20, 21, 22) == (NEW, NEW, NEW)
    check_invariants(pool)


def test_no_space_when_everything_is_pinned_or_in_flight(pool, reg):
    store(pool, reg, *range(4))
    pool.reserve_load(reg.namespace_id, reg.client_id, pack(0, 1, 2, 3))
    in_flight = pool.reserve_store(reg.namespace_id, reg.client_id, pack(*range(4, 8)))
    assert in_flight.decisions == (NEW,) * 4
    res = pool.reserve_store(reg.namespace_id, reg.client_id, pack(100, 0, 101))
    assert res.decisions == (NO_SPACE, PRESENT, NO_SPACE)
    assert (res.store_id, res.slots) == (0, ())
    assert ns_stats(pool, reg).evicted_blocks == 0
    check_invariants(pool)


def test_a_store_bigger_than_the_evictable_part_takes_every_victim(pool, reg):
    store(pool, reg, *range(8))
    pool.reserve_load(reg.namespace_id, reg.client_id, pack(0, 1))  # 6 slots stay evictable
    decisions = store(pool, reg, *range(10, 20))
    assert decisions == (NEW,) * 6 + (NO_SPACE,) * 4
    assert ns_stats(pool, reg).evicted_blocks == 6
    assert hits(pool, reg, 0, 1) == 2
    check_invariants(pool)


def test_once_full_every_later_new_key_is_no_space(pool, reg):
    store(pool, reg, 100)  # 7 slots left; 100 is in the request below, so it is not a victim
    res = pool.reserve_store(reg.namespace_id, reg.client_id, pack(*range(1, 10), 100))
    assert res.decisions == (NEW,) * 7 + (NO_SPACE,) * 2 + (PRESENT,)
    assert hits(pool, reg, 100) == 1
    check_invariants(pool)


def test_abort_frees_the_reservation(pool, reg):
    ns = reg.namespace_id
    res = pool.reserve_store(ns, reg.client_id, pack(1, 2, 3))
    assert pool.abort_store(ns, res.store_id) == 3
    assert ns_stats(pool, reg).reserved_slots == 0
    with pytest.raises(NotFound, match=f"store id {res.store_id}"):
        pool.commit_store(ns, res.store_id, 0)
    with pytest.raises(NotFound):
        pool.abort_store(ns, res.store_id)
    # The keys and slots are free again: all 8 can be stored.
    assert store(pool, reg, *range(1, 9)) == (NEW,) * 8
    check_invariants(pool)


# -- clients -----------------------------------------------------------------------------------


@pytest.mark.parametrize("grace", [0.0, 2.0])
def test_detach_releases_pins_after_the_grace_and_keeps_reservations_until_the_engine_dies(
    make_pool, small_spec, clock, grace
):
    """A session's end frees its pins (after the grace); its engine's reservations stay, however
    long, until no rank of the engine holds its lock: a copy its workers still have in flight
    can never land in a slot that another store was given."""
    pool = make_pool(clock=clock, detach_grace_s=grace)
    reg = pool.register(small_spec(), 1, 1 * MiB, "engine-0/scheduler")
    ns = reg.namespace_id
    other = pool.register(small_spec(), 1, 1 * MiB, "engine-0/rank-0")
    store(pool, reg, 1, 2)
    pool.attach(reg.client_id)
    pool.attach(other.client_id)  # a worker of the same engine, still attached
    pool.reserve_load(ns, reg.client_id, pack(1, 2))
    kept = pool.reserve_load(ns, other.client_id, pack(1))
    pool.reserve_store(ns, reg.client_id, pack(3, 4))
    assert (ns_stats(pool, reg).pinned_slots, ns_stats(pool, reg).reserved_slots) == (2, 2)
    pool.detach(reg.client_id)  # the session stream ended
    if grace:  # pins stay for the grace
        clock.advance(grace - 0.01)
        assert pool.reap_idle_clients() == 0
        stats = ns_stats(pool, reg)
        assert (stats.pinned_slots, stats.reserved_slots) == (2, 2)
        clock.advance(0.01)
        assert pool.reap_idle_clients() == 1
    stats = ns_stats(pool, reg)
    assert (stats.pinned_slots, stats.reserved_slots, stats.committed_slots) == (1, 2, 2)
    clock.advance(3600)  # no timer frees a reservation
    pool.reap_idle_clients()
    assert ns_stats(pool, reg).reserved_slots == 2
    pool.locks.kill(reg.engine)  # every rank of the engine exited: its locks are gone
    assert pool.reclaim_dead_engines() == 2
    stats = ns_stats(pool, reg)
    assert (stats.pinned_slots, stats.reserved_slots, stats.committed_slots) == (1, 0, 2)
    with pytest.raises(NotFound, match="unknown client"):
        pool.reserve_load(ns, reg.client_id, pack(1))
    with pytest.raises(NotFound):
        pool.detach(reg.client_id)
    assert pool.release(ns, other.client_id, [kept.pin_id]) == 1
    check_invariants(pool)


def test_a_store_committed_within_the_grace_stays(make_pool, small_spec, clock):
    """The scheduler's session may drop while a worker still writes its reservation: the
    worker's commit inside the grace makes the blocks visible and the reap leaves them."""
    pool = make_pool(clock=clock, detach_grace_s=2.0)
    scheduler = pool.register(small_spec(), 1, 1 * MiB, "engine-0/scheduler")
    ns = scheduler.namespace_id
    pool.attach(scheduler.client_id)
    res = pool.reserve_store(ns, scheduler.client_id, pack(1, 2))
    pool.detach(scheduler.client_id)
    clock.advance(1.0)
    assert pool.commit_store(ns, res.store_id, 0) is True  # the worker, by store id
    clock.advance(1.0)
    assert pool.reap_idle_clients() == 1
    assert hits(pool, scheduler, 1, 2) == 2
    assert ns_stats(pool, scheduler).reserved_slots == 0
    check_invariants(pool)


def test_a_client_reattaching_within_the_grace_keeps_its_pins(make_pool, small_spec, clock):
    pool = make_pool(clock=clock, detach_grace_s=2.0)
    reg = pool.register(small_spec(), 1, 1 * MiB, "engine-0/rank-0")
    store(pool, reg, 1)
    pool.attach(reg.client_id)
    pool.reserve_load(reg.namespace_id, reg.client_id, pack(1))
    pool.detach(reg.client_id)
    clock.advance(1.0)
    pool.attach(reg.client_id)  # a new stream for the same client
    clock.advance(5.0)
    assert pool.reap_idle_clients() == 0
    assert ns_stats(pool, reg).pinned_slots == 1
    check_invariants(pool)


def test_idle_clients_without_session_are_reaped(make_pool, small_spec, clock):
    pool = make_pool(clock=clock, client_timeout_s=60.0)
    idle = pool.register(small_spec(), 1, 1 * MiB, "idle")
    busy = pool.register(small_spec(), 1, 1 * MiB, "busy")
    attached = pool.register(small_spec(), 1, 1 * MiB, "attached")
    pool.attach(attached.client_id)
    store(pool, idle, 1)
    pool.reserve_load(idle.namespace_id, idle.client_id, pack(1))
    clock.advance(59)
    assert pool.reap_idle_clients() == 0
    pool.reserve_store(busy.namespace_id, busy.client_id, pack(2))  # a call keeps it live
    clock.advance(2)
    assert pool.reap_idle_clients() == 1  # only `idle`: 61 s without a call
    assert ns_stats(pool, idle).pinned_slots == 0
    assert ns_stats(pool, idle).live_clients == 2
    clock.advance(120)
    assert pool.reap_idle_clients() == 1  # `busy` now; `attached` has a session
    assert ns_stats(pool, idle).reserved_slots == 1  # its engine's: until the engine dies
    pool.locks.kill(busy.engine)
    assert pool.reclaim_dead_engines() == 1
    assert ns_stats(pool, idle).reserved_slots == 0
    check_invariants(pool)


def test_release_is_all_or_nothing_and_per_client(pool, reg, small_spec):
    ns = reg.namespace_id
    other = pool.register(small_spec(), 1, 1 * MiB, "other")
    store(pool, reg, 1, 2)
    mine = pool.reserve_load(ns, reg.client_id, pack(1, 2))
    theirs = pool.reserve_load(ns, other.client_id, pack(1))
    with pytest.raises(NotFound, match=f"pin {theirs.pin_id}"):
        pool.release(ns, reg.client_id, [mine.pin_id, theirs.pin_id])
    assert ns_stats(pool, reg).pinned_slots == 2  # nothing was released
    with pytest.raises(InvalidArgument, match="repeat"):
        pool.release(ns, reg.client_id, [mine.pin_id, mine.pin_id])
    assert pool.release(ns, reg.client_id, [mine.pin_id]) == 2
    assert pool.reserve_load(ns, reg.client_id, pack(7)) == LoadPin(0, ())
    check_invariants(pool)


# -- namespaces --------------------------------------------------------------------------------


def test_warm_restart_finds_committed_blocks(pool, reg, small_spec):
    store(pool, reg, 1, 2, 3)
    pool.attach(reg.client_id)
    pool.detach(reg.client_id)  # vLLM died
    again = pool.register(small_spec(), 1, 1 * MiB, "engine-0/scheduler")
    assert again.namespace_id == reg.namespace_id and again.regions == reg.regions
    assert again.client_id != reg.client_id and again.committed_blocks == 3
    assert hits(pool, again, 1, 2, 3) == 3
    with pytest.raises(FailedPrecondition, match="1 ranks of 1048576"):
        pool.register(small_spec(), 1, 2 * MiB, "wrong slot size")
    check_invariants(pool)


def test_a_different_spec_never_sees_another_namespace(make_pool, small_spec):
    pool = make_pool(max_namespaces=2)
    a = pool.register(small_spec(model="model-a"), 1, 1 * MiB, "a")
    b = pool.register(small_spec(model="model-b"), 1, 1 * MiB, "b")
    assert a.namespace_id != b.namespace_id
    assert a.regions[0].offset != b.regions[0].offset  # separate partitions
    store(pool, a, 1, 2)
    assert hits(pool, b, 1, 2) == 0
    assert store(pool, b, 1) == (NEW,)  # same key, other namespace: stored separately
    with pytest.raises(NotFound, match="not registered in namespace"):
        pool.reserve_load(a.namespace_id, b.client_id, pack(1))
    with pytest.raises(NotFound, match="unknown namespace"):
        pool.lookup("0" * 32, [pack(1)])
    check_invariants(pool)


def test_new_namespace_reclaims_the_lru_idle_partition(make_pool, small_spec, clock):
    pool = make_pool(max_namespaces=2, clock=clock, client_timeout_s=60.0)
    a = pool.register(small_spec(model="a"), 1, 1 * MiB, "a")
    clock.advance(1)
    b = pool.register(small_spec(model="b"), 1, 1 * MiB, "b")
    clock.advance(1)
    store(pool, a, 1)
    with pytest.raises(ResourceExhausted, match="live clients"):
        pool.register(small_spec(model="c"), 1, 1 * MiB, "c")
    clock.advance(120)  # both idle now; a was used last (its store), so b is reclaimed
    c = pool.register(small_spec(model="c"), 1, 1 * MiB, "c")
    assert c.regions[0].offset == b.regions[0].offset
    with pytest.raises(NotFound, match="unknown namespace"):
        pool.lookup(b.namespace_id, [pack(1)])
    with pytest.raises(NotFound, match="unknown client"):
        pool.attach(b.client_id)
    assert hits(pool, a, 1) == 1  # the surviving namespace is untouched
    assert {n.namespace_id for n in pool.stats().namespaces} == {a.namespace_id, c.namespace_id}
    check_invariants(pool)


def test_partition_too_small_for_one_slot(make_pool, small_spec):
    pool = make_pool(max_namespaces=2)
    with pytest.raises(ResourceExhausted, match="holds no slot"):
        pool.register(small_spec(), 1, 8 * MiB, "huge slots")
    assert pool.stats().namespaces == ()  # no partition was taken
    check_invariants(pool)


# -- pre-fault ---------------------------------------------------------------------------------


def test_slots_become_allocatable_as_the_prefault_passes_them(make_pool, small_spec):
    gate = PrefaultGate()
    pool = make_pool(prefault_gate=gate)  # 8 chunks of 1 MiB, touched only when stepped
    reg = pool.register(small_spec(), 1, 1 * MiB, "early")
    assert (reg.pool_ready, reg.prefault_fraction) == (False, 0.0)
    assert store(pool, reg, 1) == (NO_SPACE,)  # nothing pre-faulted: a miss, never a crash
    gate.step(1)
    assert store(pool, reg, 1, 2) == (NEW, NO_SPACE)  # slot 0 is ready, slot 1 is not
    gate.step(2)
    # Three ready slots behave as a pool of three: storing a fourth block evicts block 1.
    assert store(pool, reg, 2, 3, 4) == (NEW, NEW, NEW)
    assert pool.lookup(reg.namespace_id, [pack(1), pack(2, 3, 4)]) == [0, 3]
    stats = pool.stats()
    assert (stats.prefaulted_bytes, stats.pool_ready) == (3 * MiB, False)
    assert stats.namespaces[0].evicted_blocks == 1
    gate.step(6)  # the 8 slot chunks and the last one, which holds the index
    assert pool.wait_ready(5) and pool.stats().pool_ready
    assert store(pool, reg, *range(5, 10)) == (NEW,) * 5
    check_invariants(pool)


def test_prefault_advances_every_rank_region_together(make_pool, small_spec):
    gate = PrefaultGate()
    pool = make_pool(prefault_gate=gate)
    reg = pool.register(small_spec(tp_size=2), 2, 1 * MiB, "tp2")  # regions at 0 and 4 MiB
    gate.step(2)  # file order would give chunks 0 and 1: slot 0 still missing on rank 1
    assert store(pool, reg, 1) == (NEW,)
    assert pool.stats().prefaulted_bytes == 2 * MiB


# -- bad input and draining --------------------------------------------------------------------


def test_bad_arguments_raise_the_right_error_and_change_nothing(pool, reg, small_spec):
    ns, cid = reg.namespace_id, reg.client_id
    store(pool, reg, 1)
    res = pool.reserve_store(ns, cid, pack(2))
    cases = [
        (NotFound, lambda: pool.lookup("nope", [pack(1)])),
        (NotFound, lambda: pool.reserve_load(ns, 999, pack(1))),
        (NotFound, lambda: pool.attach(999)),
        (NotFound, lambda: pool.commit_store(ns, 999, 0)),
        (NotFound, lambda: pool.release(ns, cid, [12345])),
        (InvalidArgument, lambda: pool.release(ns, cid, ["1"])),
        (InvalidArgument, lambda: pool.release(ns, cid, b"\x01")),
        (InvalidArgument, lambda: pool.lookup(ns, [b""] * 70_000)),
        (InvalidArgument, lambda: pool.reserve_store(ns, cid, b"\x00" * 7)),
        (InvalidArgument, lambda: pool.lookup(ns, [pack(1), b"\x01"])),
        (InvalidArgument, lambda: pool.lookup(ns, b"not a list")),
        (InvalidArgument, lambda: pool.commit_store(ns, res.store_id, -1)),
        (InvalidArgument, lambda: pool.commit_store(ns, "1", 0)),
        (InvalidArgument, lambda: pool.reserve_load(ns, -5, pack(1))),
        (InvalidArgument, lambda: pool.register(small_spec(tp_size=2), 1, MiB, "x")),
        (InvalidArgument, lambda: pool.register(small_spec(), 0, MiB, "x")),
        (InvalidArgument, lambda: pool.register(small_spec(), 1, 100, "x")),
        (InvalidArgument, lambda: pool.register(small_spec(), 1, MiB, "x" * 300)),
        (InvalidArgument, lambda: pool.register(small_spec(model=""), 1, MiB, "x")),
        (FailedPrecondition, lambda: pool.register(small_spec(), 1, 2 * MiB, "x")),
    ]
    before = pool.stats()
    for error, call in cases:
        with pytest.raises(error) as info:
            call()
        assert isinstance(info.value, PoolError) and str(info.value)
        check_invariants(pool)
    after = pool.stats()
    assert after.namespaces[0].committed_slots == before.namespaces[0].committed_slots == 1
    assert after.namespaces[0].reserved_slots == 1
    assert pool.commit_store(ns, res.store_id, 0) is True  # the open store survived it all


def test_draining_refuses_new_work_but_finishes_old(pool, reg, small_spec):
    ns, cid = reg.namespace_id, reg.client_id
    store(pool, reg, 1)
    pin = pool.reserve_load(ns, cid, pack(1))
    res = pool.reserve_store(ns, cid, pack(2))
    pool.begin_drain()
    for call in (
        lambda: pool.register(small_spec(), 1, MiB, "late"),
        lambda: pool.reserve_store(ns, cid, pack(3)),
        lambda: pool.reserve_load(ns, cid, pack(1)),
    ):
        with pytest.raises(Unavailable, match="draining"):
            call()
    assert pool.commit_store(ns, res.store_id, 0) is True
    assert pool.release(ns, cid, [pin.pin_id]) == 1
    assert pool.lookup(ns, [pack(1, 2)]) == [2]
    check_invariants(pool)


def test_unstarted_pool_refuses_registration(make_pool, small_spec):
    pool = make_pool(start=False)
    with pytest.raises(FailedPrecondition, match="not started"):
        pool.register(small_spec(), 1, MiB, "x")


def test_bad_settings_fail_clearly(make_pool, tmp_path):
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_pool(eviction="fifo", start=False)
    with pytest.raises(ValueError, match="max_namespaces"):
        make_pool(max_namespaces=0, start=False)
    with pytest.raises(OSError, match="does not exist"):
        make_pool(pool_dir=tmp_path / "missing")
    with pytest.raises(ValueError, match="positive number of bytes"):
        make_pool(pool_size=0, start=False)


# -- randomized property test ------------------------------------------------------------------


@dataclass
class _Fuzz:
    pool: Pool
    regs: list[Registration]
    pins: dict[int, list[int]]  # client id -> pin ids it holds
    stores: list[tuple[str, int]]


def _fuzz_step(rng: random.Random, f: _Fuzz, small_spec) -> None:
    reg = rng.choice(f.regs)
    ns, cid, pool = reg.namespace_id, reg.client_id, f.pool
    keys = pack(*(rng.randrange(120) for _ in range(rng.randrange(0, 6))))
    op = rng.random()
    try:
        if op < 0.25:
            res = pool.reserve_store(ns, cid, keys)
            if res.store_id:
                f.stores.append((ns, res.store_id))
        elif op < 0.45 and f.stores:
            ns_s, sid = rng.choice(f.stores)
            ranks = [rng.randrange(2)] if rng.random() < 0.3 else [1, 0]
            if any([pool.commit_store(ns_s, sid, rank) for rank in ranks]):
                f.stores.remove((ns_s, sid))
        elif op < 0.5 and f.stores:
            ns_s, sid = f.stores.pop(rng.randrange(len(f.stores)))
            pool.abort_store(ns_s, sid)
        elif op < 0.62:
            pin = pool.reserve_load(ns, cid, keys)
            if pin.pin_id:
                f.pins.setdefault(cid, []).append(pin.pin_id)
        elif op < 0.74 and f.pins.get(cid):
            held = f.pins[cid]
            pool.release(ns, cid, [held.pop(rng.randrange(len(held)))])
        elif op < 0.86:
            pool.lookup(ns, [keys, keys[8:]])
        elif op < 0.9:  # a client dies and its engine re-registers
            pool.attach(cid)
            pool.detach(cid)
            f.pins.pop(cid, None)
            f.regs[f.regs.index(reg)] = pool.register(
                small_spec(tp_size=2, model=rng.choice(["a", "b"])), 2, 64 << 10, "again"
            )
        else:  # malformed requests: must fail cleanly
            rng.choice(
                [
                    lambda: pool.reserve_store(ns, cid, keys + b"\x00"),
                    lambda: pool.commit_store(ns, rng.randrange(1, 10_000), 5),
                    lambda: pool.release(ns, cid, [rng.randrange(1, 10_000)]),
                    lambda: pool.abort_store(ns, rng.randrange(10_000, 20_000)),
                    lambda: pool.reserve_load("f" * 32, cid, keys),
                ]
            )()
    except PoolError:
        pass  # stale ids (aborted by a detach) and malformed calls end here, by design


@pytest.mark.parametrize("eviction", POLICIES)
def test_randomized_operations_keep_every_invariant(make_pool, small_spec, eviction, vector_min):
    pool = make_pool(eviction=eviction, max_namespaces=2, pool_size=16 * MiB)
    # Two namespaces of 2 ranks, 64 KiB per rank: 64 slots each (4 MiB per rank region).
    regs = [
        pool.register(small_spec(tp_size=2, model=m), 2, 64 << 10, f"client-{i}")
        for i, m in enumerate(["a", "a", "b"])
    ]
    fuzz = _Fuzz(pool, regs, {}, [])
    rng = random.Random(20240601)
    for _batch in range(60):
        for _ in range(50):
            _fuzz_step(rng, fuzz, small_spec)
        check_invariants(pool)
    stats = pool.stats()
    assert sum(n.stored_blocks for n in stats.namespaces) > 50  # the fuzz really stored
    assert sum(n.evicted_blocks for n in stats.namespaces) > 0  # and really evicted


def test_threads_racing_with_the_prefault_keep_every_invariant(make_pool, small_spec, vector_min):
    """Four client threads store, load and release the same keys while the pre-fault thread
    is still advancing the allocatable frontier; afterwards the index is consistent."""
    pool = make_pool(start=False, pool_size=32 * MiB)
    pool.start()  # not waiting: the pre-fault runs during the race
    regs = [pool.register(small_spec(), 1, 256 << 10, f"t{i}") for i in range(4)]
    errors: list[BaseException] = []

    def client(reg: Registration, seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                keys = pack(*(rng.randrange(300) for _ in range(rng.randrange(1, 8))))
                res = pool.reserve_store(reg.namespace_id, reg.client_id, keys)
                if res.store_id:
                    pool.commit_store(reg.namespace_id, res.store_id, 0)
                pin = pool.reserve_load(reg.namespace_id, reg.client_id, keys)
                if pin.pin_id:
                    pool.release(reg.namespace_id, reg.client_id, [pin.pin_id])
        except BaseException as e:  # surfaced below with its traceback
            errors.append(e)

    threads = [threading.Thread(target=client, args=(r, i)) for i, r in enumerate(regs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert pool.wait_ready(30)
    check_invariants(pool)
    ns = ns_stats(pool, regs[0])
    assert ns.stored_blocks > 0 and ns.pinned_slots == 0 and ns.reserved_slots == 0
