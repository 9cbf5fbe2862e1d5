"""The batched hot paths (whole-list index, allocator, policy and encoder steps) give exactly the
answers of the key-at-a-time rules they replaced.

Each test drives the batched call and a plain key-by-key reference side by side: single-key
calls of the same API, or a small model of the documented rules computed from the pool's state
just before the call. Random histories are seeded, so a failure repeats.
"""

from __future__ import annotations

import random
import struct

import pytest
from kvoffload.v1 import pool_pb2 as pb
from kvoffload_sidecar import allocator, convert, keymap, pool_lookups
from kvoffload_sidecar.allocator import FreeSlots
from kvoffload_sidecar.index import SlotIndex, SlotState
from kvoffload_sidecar.keys import PoolKey
from kvoffload_sidecar.policies import make_policy
from kvoffload_sidecar.policies.arc import ARCPolicy
from kvoffload_sidecar.pool import LoadPin, Pool, StoreDecision, StoreReservation
from pool_invariants import check_invariants

MiB = 1 << 20
NEW, PRESENT, NO_SPACE = StoreDecision.NEW, StoreDecision.PRESENT, StoreDecision.NO_SPACE
POLICIES = ["lru", "arc"]


def key_bytes(i: int) -> PoolKey:
    return PoolKey(i.to_bytes(8, "big"))


def pack(ints: list[int]) -> bytes:
    return b"".join(key_bytes(i) for i in ints)


# -- allocator ---------------------------------------------------------------------------------


def test_allocate_many_hands_out_what_repeated_allocate_would(vector_min):
    rng = random.Random(7)
    batched, single = FreeSlots(64), FreeSlots(64)
    held: list[int] = []
    for step in range(400):
        if step % 50 == 0:
            ready = min(64, step // 5 + 8)
            batched.set_ready(ready)
            single.set_ready(ready)
        if held and rng.random() < 0.45:
            rng.shuffle(held)
            cut = rng.randint(1, len(held))
            back, held = held[:cut], held[cut:]
            batched.release_many(back)
            for slot in back:
                single.release(slot)
        else:
            n = rng.randint(0, 12)
            got = batched.allocate_many(n)
            expected = [s for s in (single.allocate() for _ in range(n)) if s is not None]
            got = [int(s) for s in got]  # a list, or an array from the numpy path
            assert got == expected
            held += got
        assert batched.available() == single.available()
        assert batched.free_slots() == single.free_slots()


def test_release_many_is_all_or_nothing(vector_min):
    free = FreeSlots(8)
    free.set_ready(8)
    taken = free.allocate_many(3)
    with pytest.raises(ValueError, match="slot 5 was never allocated"):
        free.release_many([taken[0], 5])
    assert free.available() == 5  # nothing went back
    free.release_many(taken)
    assert free.available() == 8


# -- index -------------------------------------------------------------------------------------


def test_reserve_many_and_evict_many_refuse_used_keys_or_slots_and_change_nothing(vector_min):
    index = SlotIndex(slot_count=8, num_ranks=1)
    index.reserve_many([key_bytes(1), key_bytes(2)], [0, 1])
    with pytest.raises(ValueError, match="key of the batch is already in use"):
        index.reserve_many([key_bytes(3), key_bytes(2)], [2, 3])
    with pytest.raises(ValueError, match="slot 1 is already in use"):
        index.reserve_many([key_bytes(3), key_bytes(4)], [2, 1])
    assert (index.find(key_bytes(3)), index.state(2), index.counts.reserved) == (
        None,
        SlotState.FREE,
        2,
    )
    index.open_store(1, owner=1, slots=[0, 1], keys=[key_bytes(1), key_bytes(2)])
    assert index.commit_rank(1, 0) == [key_bytes(1), key_bytes(2)]
    index.pin(1, client_id=1, slots=[1])
    with pytest.raises(ValueError, match="not an unpinned committed slot"):
        index.evict_many([key_bytes(1), key_bytes(2)])  # 2 is pinned: 1 stays too
    assert index.counts.committed == 2 and index.find(key_bytes(1)) == 0
    index.unpin(1)
    assert index.evict_many([key_bytes(2), key_bytes(1)]) == [1, 0]
    index.check(free_slots=set(range(8)))


def test_pin_prefix_pins_the_committed_prefix_only(vector_min):
    index = SlotIndex(slot_count=8, num_ranks=1, key_size=8)
    index.reserve_many([key_bytes(i) for i in range(4)], [3, 2, 1, 0])
    index.open_store(1, 1, [3, 2], [key_bytes(0), key_bytes(1)])  # these become visible
    index.open_store(2, 1, [1, 0], [key_bytes(2), key_bytes(3)])  # these stay reserved
    index.commit_rank(1, 0)
    assert index.pin_prefix_packed(5, 1, key_bytes(2) + key_bytes(0)) is None  # reserved: invisible
    record = index.pin_prefix_packed(
        6, 1, key_bytes(0) + key_bytes(1) + key_bytes(2) + key_bytes(0)
    )
    assert record is not None and list(record.slots) == [3, 2]
    assert (index.pin_count(3), index.pin_count(2), index.counts.pinned) == (1, 1, 2)
    index.check(free_slots=set(range(4, 8)))


# -- policies ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", POLICIES)
def test_batched_touch_orders_keys_like_one_key_at_a_time(name):
    """Duplicates and keys the policy does not hold included (those take the fallback path)."""
    rng = random.Random(11)
    batched, single = make_policy(name, 32), make_policy(name, 32)
    for i in range(24):
        batched.insert(key_bytes(i))
        single.insert(key_bytes(i))
    for _ in range(200):
        keys = [key_bytes(rng.randrange(30)) for _ in range(rng.randint(0, 10))]
        batched.touch(keys)
        for key in keys:
            single.touch([key])
        assert list(batched.keys()) == list(single.keys())
        if rng.random() < 0.2:  # evictions and re-inserts (ARC: ghost hits) keep lists moving
            protected = {key_bytes(rng.randrange(24))}
            victims = batched.evict(2, protected)
            assert victims is not None and victims == single.evict(2, protected)
            for key in victims:
                batched.insert(key)
                single.insert(key)
            assert list(batched.keys()) == list(single.keys())


def _arc_evict_key_by_key(arc: ARCPolicy, n: int, protected: set[PoolKey]) -> list | None:
    """ARC's victim choice one key at a time, as the policy was first written (the reference)."""
    if n <= 0:
        return []
    if n > len(arc._t1) + len(arc._t2):  # noqa: SLF001 - the reference works on the lists
        return None
    cand1 = (k for k in arc._t1 if k not in protected)  # noqa: SLF001
    cand2 = (k for k in arc._t2 if k not in protected)  # noqa: SLF001
    next1, next2 = next(cand1, None), next(cand2, None)
    t1_len, from_t1, from_t2 = len(arc._t1), [], []  # noqa: SLF001
    for _ in range(n):
        if next1 is None and next2 is None:
            return None
        if next1 is not None and (t1_len > arc.p or next2 is None):
            from_t1.append(next1)
            t1_len -= 1
            next1 = next(cand1, None)
        else:
            from_t2.append(next2)
            next2 = next(cand2, None)
    for key in from_t1:
        del arc._t1[key]  # noqa: SLF001
        arc._b1[key] = None  # noqa: SLF001
    for key in from_t2:
        del arc._t2[key]  # noqa: SLF001
        arc._b2[key] = None  # noqa: SLF001
    b1, b2 = arc._b1, arc._b2  # noqa: SLF001
    while b1 and len(arc._t1) + len(b1) > arc.capacity:  # noqa: SLF001
        b1.popitem(last=False)
    while len(b1) + len(b2) > arc.capacity:
        (b2 if len(b2) >= len(b1) else b1).popitem(last=False)
    return from_t1 + from_t2


def test_arc_batched_evict_picks_the_victims_of_the_key_by_key_rule():
    """Random inserts (ghost hits move p), touches and evictions of 1..12 keys, some out of
    reach, with random protected keys: same victims, same T1/T2/B1/B2 order, same p."""
    rng = random.Random(5)
    cap = 8
    batched, reference = ARCPolicy(cap), ARCPolicy(cap)
    held: list[PoolKey] = []
    for _ in range(3000):
        op = rng.random()
        if op < 0.45 and len(held) < cap:
            key = key_bytes(rng.randrange(30))
            if key not in batched:
                batched.insert(key)
                reference.insert(key)
                held.append(key)
        elif op < 0.7:
            keys = [key_bytes(rng.randrange(30)) for _ in range(rng.randint(1, 6))]
            batched.touch(keys)
            reference.touch(keys)
        else:
            n = rng.randint(1, cap + 2)
            protected = set(rng.sample(held, min(len(held), rng.randint(0, 4))))
            victims = batched.evict(n, protected)
            assert victims == _arc_evict_key_by_key(reference, n, protected)
            held = [k for k in held if k not in (victims or ())]
        state = [list(getattr(p, name)) for p in (batched, reference) for name in _ARC_LISTS]
        assert state[:4] == state[4:] and batched.p == reference.p
        t1, _, b1, b2 = state[:4]
        assert len(t1) + len(b1) <= cap and len(b1) + len(b2) <= cap  # the ghost bounds


_ARC_LISTS = ("_t1", "_t2", "_b1", "_b2")


# -- pool: reserve_store decisions against the documented rule ---------------------------------


def _expected_store(pool: Pool, ns_id: str, keys: list[PoolKey]) -> tuple[tuple, int]:
    """(decisions, evictions) the key-by-key rule gives from the pool's current state: PRESENT
    for keys in the index and repeats of a stored key; the first occurrences of the other keys
    take free slots, then slots of evicted unpinned committed keys not in the request; every
    occurrence of a key left over is NO_SPACE."""
    ns = pool._namespaces[ns_id]  # noqa: SLF001 - the model reads the state the rule depends on
    index = ns.index
    request = set(keys)
    fresh = list(dict.fromkeys(k for k in keys if index.find(k) is None))
    evictable = sum(
        1 for k in index.committed_keys() if k not in request and not index.pin_count(index.find(k))
    )
    room = min(len(fresh), ns.free.available() + evictable)
    stored = set(fresh[:room])
    decisions, seen = [], set()
    for key in keys:
        if key in stored and key not in seen:
            decisions.append(NEW)
            seen.add(key)
        elif key in stored or index.find(key) is not None:
            decisions.append(PRESENT)
        else:
            decisions.append(NO_SPACE)
    return tuple(decisions), max(0, room - ns.free.available())


@pytest.mark.parametrize("name", POLICIES)
def test_random_histories_match_the_key_by_key_rules(make_pool, small_spec, name, vector_min):
    pool = make_pool(eviction=name)  # 8 MiB of 1 MiB slots: 8 slots, so it fills quickly
    reg = pool.register(small_spec(), 1, MiB, "test")
    ns, cid = reg.namespace_id, reg.client_id
    rng = random.Random(20261122)
    stores: dict[int, tuple[PoolKey, ...]] = {}
    pins: list[int] = []
    for _ in range(600):
        op = rng.random()
        ints = [rng.randrange(20) for _ in range(rng.randint(1, 12))]
        keys = [key_bytes(i) for i in ints]
        if op < 0.4:
            expected, evictions = _expected_store(pool, ns, keys)
            evicted_before = pool.stats().namespaces[0].evicted_blocks
            res = pool.reserve_store(ns, cid, pack(ints))
            assert res.decisions == expected
            assert pool.stats().namespaces[0].evicted_blocks - evicted_before == evictions
            new = tuple(k for k, d in zip(keys, res.decisions, strict=True) if d == NEW)
            index = pool._namespaces[ns].index  # noqa: SLF001
            assert [index.find(k) for k in new] == list(res.slots)
            assert len(set(res.slots)) == len(res.slots)
            if res.store_id:
                stores[res.store_id] = new
        elif op < 0.6 and stores:
            store_id = rng.choice(list(stores))
            if rng.random() < 0.7:
                assert pool.commit_store(ns, store_id, 0) is True
                assert pool.lookup(ns, [b"".join(stores[store_id])]) == [len(stores[store_id])]
            else:
                assert pool.abort_store(ns, store_id) == len(stores[store_id])
            del stores[store_id]
        elif op < 0.75:
            committed = pool._namespaces[ns].index.committed_keys()  # noqa: SLF001
            prefix = next((i for i, k in enumerate(keys) if k not in committed), len(keys))
            assert pool.lookup(ns, [pack(ints)]) == [prefix]
            pin = pool.reserve_load(ns, cid, pack(ints))
            assert len(pin.slots) == prefix and (pin.pin_id > 0) == (prefix > 0)
            if pin.pin_id:
                pins.append(pin.pin_id)
        elif pins:
            release = rng.sample(pins, rng.randint(1, len(pins)))
            pool.release(ns, cid, release)
            pins = [p for p in pins if p not in release]
        check_invariants(pool)


@pytest.mark.parametrize("name", POLICIES)
def test_numpy_and_loop_paths_give_identical_answers(
    make_pool, small_spec, tmp_path, name, monkeypatch
):
    """The same seeded history of 2..80-key calls (repeats, partial hits, eviction, pins of
    repeated keys) against a pool whose index and allocator take the numpy paths from 2 slots
    up, one that loops over every batch, and (where it is built) one whose key map is the
    native one: every answer and every counter is the same. (Ids start at 1 in every pool
    here, not at a random base per process, so that answers compare.)"""
    monkeypatch.setattr(Pool, "_id_base", staticmethod(lambda: 1))
    kinds = [(1, False), (1 << 30, False)] + ([(1, True)] if keymap.NativeKeyMap else [])
    pools, regs = {}, {}
    for vector_min, native in kinds:
        where = tmp_path / f"{vector_min}-{native}"
        where.mkdir()
        pools[vector_min, native] = pool = make_pool(eviction=name, pool_dir=where, prefault=False)
        with pytest.MonkeyPatch.context() as mp:  # the key map's kind is chosen at register
            mp.setenv("KVOFFLOAD_NATIVE_INDEX", "1" if native else "0")
            regs[vector_min, native] = pool.register(small_spec(), 1, 64 << 10, "t")  # 128 slots
    rng = random.Random(20261123)
    stores: list[int] = []
    pins: list[int] = []

    def normal(answer):  # noqa: ANN001, ANN202 - slots may be a tuple or an int array
        if isinstance(answer, LoadPin):
            return ("pin", answer.pin_id, tuple(map(int, answer.slots)))
        if isinstance(answer, StoreReservation):
            return ("store", answer.store_id, answer.decisions, tuple(map(int, answer.slots)))
        return answer

    def both(call):  # noqa: ANN001, ANN202 - call(pool, namespace, client) on each pool
        answers, raws = [], []
        for (vector_min, native), pool in pools.items():
            allocator.VECTOR_MIN = vector_min
            reg = regs[vector_min, native]
            try:
                raws.append(call(pool, reg.namespace_id, reg.client_id))
            except Exception as exc:  # noqa: BLE001 - compared like answers
                raws.append((type(exc), str(exc)))
            answers.append(normal(raws[-1]))
        assert all(a == answers[0] for a in answers), answers
        return raws[0]

    default = allocator.VECTOR_MIN
    try:
        for step in range(600):
            op = rng.random()
            first = rng.randrange(120)  # runs of consecutive keys: prefixes hit and miss
            ints = list(range(first, first + rng.randint(2, 80)))
            if rng.random() < 0.2:  # a repeated key
                ints[rng.randrange(len(ints)) :] = [ints[0]] * 3
            keys = pack(ints)
            if op < 0.35:
                res = both(lambda p, ns, cid, k=keys: p.reserve_store(ns, cid, k))
                if isinstance(res, StoreReservation) and res.store_id:
                    if rng.random() < 0.8:
                        both(lambda p, ns, cid, s=res.store_id: p.commit_store(ns, s, 0))
                    else:
                        stores.append(res.store_id)
            elif op < 0.45 and stores:
                sid = stores.pop(rng.randrange(len(stores)))
                if rng.random() < 0.5:
                    both(lambda p, ns, cid, s=sid: p.commit_store(ns, s, 0))
                else:
                    both(lambda p, ns, cid, s=sid: p.abort_store(ns, s))
            elif op < 0.6:
                both(lambda p, ns, cid, k=keys: p.lookup(ns, [k, k[8:]]))
            elif op < 0.8:
                pin = both(lambda p, ns, cid, k=keys: p.reserve_load(ns, cid, k))
                if pin.pin_id:
                    pins.append(pin.pin_id)
            elif pins:
                release = rng.sample(pins, rng.randint(1, min(3, len(pins))))
                both(lambda p, ns, cid, r=release: p.release(ns, cid, r))
                pins = [p for p in pins if p not in release]
            if step % 25 == 0:
                both(lambda p, ns, cid: (check_invariants(p), p.stats().namespaces))
        both(lambda p, ns, cid: (check_invariants(p), p.stats().namespaces))
        stats = pools[1, False].stats().namespaces[0]
        assert stats.evicted_blocks > 500 and stats.loaded_blocks > 1000, stats
    finally:
        allocator.VECTOR_MIN = default


def test_a_repeated_key_in_a_big_new_batch_takes_the_general_path_unchanged(make_pool, small_spec):
    """The fast path reserves assuming distinct keys and finds the repeat as the dict grows:
    it must undo everything (index and allocator) and answer like the general path."""
    pool = make_pool(prefault=False, pool_size=16 * MiB)
    reg = pool.register(small_spec(), 1, 64 << 10, "t")  # 256 slots
    ns, cid = reg.namespace_id, reg.client_id
    free = pool._namespaces[ns].free  # noqa: SLF001
    first = pool.reserve_store(ns, cid, pack(list(range(40))))
    pool.abort_store(ns, first.store_id)  # the freed stack now holds 40 slots
    ints = list(range(100, 140)) + [105] + list(range(140, 160))
    expected, _ = _expected_store(pool, ns, [key_bytes(i) for i in ints])
    mark = free.mark()
    res = pool.reserve_store(ns, cid, pack(ints))
    assert res.decisions == expected and len(res.slots) == 60 == len(set(res.slots))
    assert res.decisions[40] == PRESENT  # the repeat of key 105
    index = pool._namespaces[ns].index  # noqa: SLF001
    assert [index.find(key_bytes(i)) for i in range(100, 160)] == list(res.slots)
    assert free.mark() == (0, mark[1] + 20)  # the 40 freed slots first, then 20 fresh ones
    check_invariants(pool)


@pytest.mark.parametrize("name", POLICIES)
def test_deferred_touches_evict_exactly_like_immediate_ones(
    make_pool, small_spec, tmp_path, name, monkeypatch
):
    """Lookups and loads queue their policy touches until `flush_deferred` or the next policy
    use: a pool flushed after every call and one never flushed evict the same keys and end with
    the same policy order."""
    monkeypatch.setattr(pool_lookups, "DEFER_TOUCH_MIN", 2)  # queue from 2 keys up, not 256
    monkeypatch.setattr(Pool, "_id_base", staticmethod(lambda: 1))  # ids compare across pools
    pools = []
    for d in ("flushed", "queued"):
        (tmp_path / d).mkdir()
        pools.append(make_pool(eviction=name, pool_dir=tmp_path / d, prefault=False))
    regs = [p.register(small_spec(), 1, 64 << 10, "t") for p in pools]  # 128 slots
    rng = random.Random(7)
    queued = 0
    for _ in range(400):
        first = rng.randrange(300)
        keys = pack(list(range(first, first + rng.randint(1, 60))))
        op = rng.random()
        answers = []
        for i, (pool, reg) in enumerate(zip(pools, regs, strict=True)):
            ns, cid = reg.namespace_id, reg.client_id
            if op < 0.4:
                res = pool.reserve_store(ns, cid, keys)
                if res.store_id:
                    pool.commit_store(ns, res.store_id, 0)
                answers.append(res)
            elif op < 0.7:
                answers.append(pool.lookup(ns, [keys]))
            else:
                pin = pool.reserve_load(ns, cid, keys)
                if pin.pin_id:
                    pool.release(ns, cid, [pin.pin_id])
                answers.append(pin)
            if i == 0:
                pool.flush_deferred()
        assert answers[0] == answers[1]
        queued += bool(pools[1]._namespaces[regs[1].namespace_id].touches)  # noqa: SLF001
    assert queued > 50  # the queued pool really deferred its touches, often
    policies = [p._namespaces[r.namespace_id].policy for p, r in zip(pools, regs, strict=True)]  # noqa: SLF001
    pools[1].flush_deferred()
    assert list(policies[0].keys()) == list(policies[1].keys())
    for pool in pools:
        check_invariants(pool)
    assert pools[0].stats().namespaces[0].evicted_blocks > 500


# -- servicer encoding -------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 127, 1024, 20_000])
def test_answers_pack_decisions_and_slots(n):
    """A store answer carries one byte per decision (its StoreDecision number) and the slots as
    4-byte little-endian uint32s (the whole 32-bit range), alone and inside a Session envelope;
    a load answer packs its slots the same way."""
    decisions = tuple((NEW, PRESENT, NO_SPACE)[(i * 7) % 3] for i in range(n))
    slots = tuple((i * 2_654_435_761) % (1 << 32) for i in range(n))
    res = StoreReservation(9, decisions, slots)
    out = pb.ReserveStoreResponse()
    convert.store_reservation_to_proto(res, out)
    assert out.store_id == 9 and list(out.decisions) == [int(d) for d in decisions]
    assert struct.unpack(f"<{n}I", out.slots) == slots
    envelope = pb.SessionResponse(seq=3)
    inner = envelope.reserve_store
    inner.SetInParent()
    convert.store_reservation_to_proto(res, inner)
    decoded = pb.SessionResponse.FromString(envelope.SerializeToString())
    assert decoded.seq == 3 and decoded.reserve_store == out
    all_new = StoreReservation(4, (NEW,) * n, slots)
    convert.store_reservation_to_proto(all_new, out)
    assert out.decisions == bytes([pb.STORE_DECISION_NEW]) * n
    pin = pb.ReserveLoadResponse()
    convert.load_pin_to_proto(LoadPin(5, slots), pin)
    assert pin.pin_id == 5 and struct.unpack(f"<{n}I", pin.slots) == slots
