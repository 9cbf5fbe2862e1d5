"""The pool file's own index (persist.py): a second `Pool` on the same file, as a sidecar
restarted after SIGKILL would be, adopts exactly the committed blocks and nothing it cannot
trust. In-process: the file and its bytes are real (tmpfs); the kill is the first pool simply
never running again (a SIGKILL writes nothing either). tests/sidecar/test_adoption_process.py
kills real processes."""

from __future__ import annotations

import random
import struct
import time

import numpy as np
import pytest
from kvoffload_sidecar import persist
from kvoffload_sidecar.keys import NamespaceSpec
from kvoffload_sidecar.pool import Pool, Registration, StoreDecision
from pool_invariants import check_invariants

MiB = 1 << 20
NEW, PRESENT, NO_SPACE = StoreDecision.NEW, StoreDecision.PRESENT, StoreDecision.NO_SPACE


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def pack(*ints: int) -> bytes:
    return b"".join(i.to_bytes(8, "big") for i in ints)


def store(pool: Pool, reg: Registration, *ints: int, commit: bool = True) -> tuple[int, ...]:
    res = pool.reserve_store(reg.namespace_id, reg.client_id, pack(*ints))
    if res.store_id and commit:
        for rank in range(len(reg.regions)):
            pool.commit_store(reg.namespace_id, res.store_id, rank)
    return tuple(map(int, res.slots))


def slot_bytes(pool: Pool, reg: Registration, slot: int, rank: int = 0) -> bytes:
    r = reg.regions[rank]
    start = r.offset + slot * r.slot_bytes
    return bytes(pool.region.buffer[start : start + r.slot_bytes])


def fill_slot(pool: Pool, reg: Registration, slot: int, tag: int) -> None:
    """What a connector's copy does: write the block's bytes into its slot, every rank."""
    for r in reg.regions:
        start = r.offset + slot * r.slot_bytes
        pool.region.buffer[start : start + r.slot_bytes] = bytes([tag % 256]) * r.slot_bytes


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def pair(make_pool, small_spec, clock):
    """(make the first pool, adopt into a second) on one pool dir, same settings."""

    def first(tp: int = 1, **kw: object) -> tuple[Pool, Registration]:
        pool = make_pool(clock=clock, **kw)
        spec = small_spec(tp_size=tp)
        return pool, pool.register(spec, tp, 1 * MiB, "engine")

    def again(**kw: object) -> Pool:
        return make_pool(clock=clock, **kw)

    return first, again


def reregister(pool: Pool, spec: NamespaceSpec, ranks: int = 1) -> Registration:
    return pool.register(spec, ranks, 1 * MiB, "engine-after")


def test_committed_blocks_survive_with_their_bytes_and_the_generation(pair, small_spec):
    first, again = pair
    a, reg = first()
    slots = store(a, reg, 1, 2, 3)
    for i, slot in enumerate(slots):
        fill_slot(a, reg, slot, 10 + i)
    b = again()
    assert b.adoption.outcome == "adopted" and b.adoption.adopted_blocks == 3
    assert b.generation == a.generation and b.adoption.boots == 2
    reg2 = reregister(b, small_spec())
    assert reg2.regions == reg.regions and reg2.committed_blocks == 3
    pin = b.reserve_load(reg2.namespace_id, reg2.client_id, pack(1, 2, 3, 4))
    assert tuple(map(int, pin.slots)) == slots  # same keys, same slots
    assert [slot_bytes(b, reg2, s)[:1] for s in slots] == [b"\x0a", b"\x0b", b"\x0c"]
    check_invariants(b)


def test_reservations_and_pins_of_the_dead_instance_are_not_kept(pair, small_spec, clock):
    first, again = pair
    a, reg = first()
    store(a, reg, 1, 2)
    a.reserve_load(reg.namespace_id, reg.client_id, pack(1, 2))  # a pin nobody releases
    in_flight = store(a, reg, 3, 4, commit=False)  # bytes may be half written
    b = again()
    assert b.adoption.adopted_blocks == 2
    assert b.adoption.discarded == {"reserved": 2}
    reg2 = reregister(b, small_spec())
    assert b.lookup(reg2.namespace_id, [pack(1, 2, 3)]) == [2]  # 3 was never visible
    (ns,) = b.stats().namespaces
    assert (ns.pinned_slots, ns.reserved_slots) == (0, 0)
    # The rest of the pool takes stores at once; the slots being written at death do not.
    got = store(b, reg2, *range(100, 104))
    assert len(got) == 4 and not set(got) & set(in_flight)
    assert store(b, reg2, 200) == ()  # full: 2 adopted + 4 new, 2 withheld; no eviction yet
    clock.now += 3600  # no timer ends the hold: the owning engine may still copy
    b.reap_idle_clients()
    assert set(b._namespaces[reg.namespace_id].withheld.tolist()) == set(in_flight)  # noqa: SLF001
    b.locks.kill(reg.engine)  # every rank of the engine that reserved them exited
    b.reap_idle_clients()  # the reaper tick probes the owners
    assert len(b._namespaces[reg.namespace_id].withheld) == 0  # noqa: SLF001
    check_invariants(b)


def test_adopted_blocks_are_not_evicted_during_the_grace(pair, small_spec, clock):
    first, again = pair
    a, reg = first()
    store(a, reg, *range(8))  # the pool is full
    b = again()
    reg2 = reregister(b, small_spec())
    assert store(b, reg2, 50) == ()  # an in-flight load of the dead instance may read any
    clock.now += b.settings.detach_grace_s + 0.1
    assert len(store(b, reg2, 50)) == 1  # the oldest adopted block makes room
    assert b.lookup(reg2.namespace_id, [pack(0), pack(1)]) == [0, 1]
    check_invariants(b)


def test_a_torn_commit_record_is_never_served(pair, small_spec):
    first, again = pair
    a, reg = first()
    slots = store(a, reg, 1, 2, 3)
    table = a._namespaces[reg.namespace_id].table  # noqa: SLF001 - the file's own records
    table.words[slots[1], 3] ^= np.uint64(1 << 40)  # the key changed, the check did not
    b = again()
    assert b.adoption.adopted_blocks == 2 and b.adoption.discarded == {"torn": 1}
    reg2 = reregister(b, small_spec())
    assert b.lookup(reg2.namespace_id, [pack(1), pack(2), pack(3)]) == [1, 0, 1]
    check_invariants(b)


def test_an_older_copy_of_a_key_loses_to_the_newer(pair, small_spec):
    first, again = pair
    a, reg = first()
    (slot,) = store(a, reg, 7)
    ns = a._namespaces[reg.namespace_id]  # noqa: SLF001
    stale = 5 if slot != 5 else 6  # an evicted, intact copy of the same key, committed earlier
    ns.table.commit([stale], pack(7), persist.FIRST_SEQ)
    b = again()
    assert b.adoption.discarded == {"duplicate": 1}
    reg2 = reregister(b, small_spec())
    pin = b.reserve_load(reg2.namespace_id, reg2.client_id, pack(7))
    assert tuple(map(int, pin.slots)) == (slot,)
    check_invariants(b)


def test_a_newer_format_is_discarded_cleanly(pair, small_spec):
    first, again = pair
    a, reg = first()
    store(a, reg, 1, 2)
    header = a.settings.pool_size - persist.HEADER_BYTES
    struct.pack_into("<I", a.region.buffer, header + 8, persist.FORMAT_VERSION + 1)
    b = again()
    assert b.adoption.outcome == "discarded"
    assert f"v{persist.FORMAT_VERSION + 1} is newer" in b.adoption.reason
    assert b.adoption.format_version == persist.FORMAT_VERSION + 1
    assert b.generation != a.generation  # connectors re-map
    reg2 = reregister(b, small_spec())
    assert b.lookup(reg2.namespace_id, [pack(1)]) == [0]
    # and the pool is usable (after the usual quarantine of a file it did not adopt)
    c = again()  # the discarding start wrote a fresh header: the next start adopts it
    assert c.adoption.outcome == "adopted" and c.generation == b.generation


@pytest.mark.parametrize("change", ["partitions", "size"])
def test_other_settings_discard_the_pool(pair, change):
    first, again = pair
    a, reg = first()
    store(a, reg, 1)
    kw = {"max_namespaces": 2} if change == "partitions" else {"pool_size": 16 * MiB}
    b = again(**kw)
    assert b.adoption.outcome == "discarded"
    # the header sits at the file's end: a new size finds none there
    assert ("other settings" if change == "partitions" else "size changed") in b.adoption.reason


def test_a_damaged_namespace_record_is_skipped(pair, small_spec):
    first, again = pair
    a, reg = first()
    store(a, reg, 1)
    layout = a._namespaces[reg.namespace_id].layout  # noqa: SLF001
    a.region.buffer[layout.spec_offset] ^= 0xFF  # its spec no longer matches the check
    b = again()
    assert b.adoption.outcome == "adopted" and b.adoption.adopted_blocks == 0
    assert b.adoption.discarded == {"namespace": 1}
    reg2 = reregister(b, small_spec())
    assert b.lookup(reg2.namespace_id, [pack(1)]) == [0]
    check_invariants(b)


def test_tp2_blocks_commit_only_when_every_rank_did(pair, small_spec):
    first, again = pair
    a, reg = first(tp=2)
    res = a.reserve_store(reg.namespace_id, reg.client_id, pack(1, 2))
    a.commit_store(reg.namespace_id, res.store_id, 0)  # rank 1 never commits: not visible
    store(a, reg, 3)
    b = again()
    assert b.adoption.adopted_blocks == 1 and b.adoption.discarded == {"reserved": 2}
    reg2 = reregister(b, small_spec(tp_size=2), ranks=2)
    assert b.lookup(reg2.namespace_id, [pack(1), pack(3)]) == [0, 1]


def test_restart_after_restart_keeps_old_and_new_blocks(pair, small_spec, clock):
    first, again = pair
    a, reg = first()
    store(a, reg, 1, 2)
    b = again()
    reg2 = reregister(b, small_spec())
    store(b, reg2, 3)
    c = again()
    assert c.adoption.boots == 3 and c.adoption.adopted_blocks == 3
    reg3 = reregister(c, small_spec())
    assert c.lookup(reg3.namespace_id, [pack(1, 2, 3)]) == [3]
    check_invariants(c)


@pytest.mark.parametrize("seed", range(6))
def test_random_histories_adopt_exactly_what_was_committed(pair, small_spec, clock, seed):
    """Random stores, commits, aborts, pins, releases and evictions, then a "kill" at a random
    point: the adopter serves every block committed and not evicted at that point, with its
    bytes, and never a key that was only reserved."""
    rng = random.Random(seed)
    first, again = pair
    a, reg = first()
    ns, cid = reg.namespace_id, reg.client_id
    committed: dict[int, int] = {}  # key -> tag of its bytes
    open_stores: list[tuple[int, list[int]]] = []
    pins: list[int] = []
    tag = 0
    for _ in range(rng.randint(5, 60)):
        op = rng.random()
        if op < 0.45:
            ks = rng.sample(range(40), rng.randint(1, 4))
            res = a.reserve_store(ns, cid, pack(*ks))
            new = [k for k, d in zip(ks, res.decisions, strict=True) if d == NEW]
            for k, slot in zip(new, map(int, res.slots), strict=True):
                tag += 1
                fill_slot(a, reg, slot, tag)
                committed_tag = tag
                committed.setdefault(-k - 1, committed_tag)  # pending until commit
            if res.store_id:
                open_stores.append((res.store_id, new))
        elif op < 0.7 and open_stores:
            store_id, ks = open_stores.pop(rng.randrange(len(open_stores)))
            a.commit_store(ns, store_id, 0)
            for k in ks:
                committed[k] = committed.pop(-k - 1)
        elif op < 0.8 and open_stores:
            store_id, ks = open_stores.pop(rng.randrange(len(open_stores)))
            a.abort_store(ns, store_id)
            for k in ks:
                committed.pop(-k - 1, None)
        elif op < 0.9:
            pin = a.reserve_load(ns, cid, pack(*rng.sample(range(40), 2)))
            if pin.pin_id:
                pins.append(pin.pin_id)
        elif pins:
            a.release(ns, cid, [pins.pop()])
    check_invariants(a)
    visible = {k for k in range(40) if a.lookup(ns, [pack(k)]) == [1]}
    expected_tag = {k: t for k, t in committed.items() if k >= 0 and k in visible}
    b = again()
    reg2 = reregister(b, small_spec())
    adopted = {k for k in range(40) if b.lookup(reg2.namespace_id, [pack(k)]) == [1]}
    # every visible block is kept; an evicted one may come back only with its own bytes
    assert visible <= adopted
    for k in adopted:
        pin = b.reserve_load(reg2.namespace_id, reg2.client_id, pack(k))
        got = slot_bytes(b, reg2, int(pin.slots[0]))
        assert k in committed or k in visible, f"key {k} was never committed"
        if k in expected_tag:
            assert got[:1] == bytes([expected_tag[k] % 256]), f"key {k}: wrong bytes"
    check_invariants(b)


def test_the_scalar_and_numpy_record_checks_agree() -> None:
    """Small commits take the Python path, large ones numpy: both must write what a restart
    validates, for keys whose size is and is not a multiple of 8."""
    rng = np.random.default_rng(7)
    for words in (1, 5, 32):
        keys = rng.integers(0, 2**63, size=(40, words), dtype=np.uint64) * 2 + 1
        slots = np.arange(40, dtype=np.intp) * 3
        states = rng.integers(2, 2**40, size=40, dtype=np.uint64)
        vector = persist.record_check(987654321, slots, states, keys).tolist()
        scalar = [
            persist.record_check_one(987654321, int(s), int(st), tuple(map(int, k)))
            for s, st, k in zip(slots, states, keys, strict=True)
        ]
        assert vector == scalar


@pytest.mark.parametrize("batch", [1, persist.SCALAR_MAX, persist.SCALAR_MAX + 1, 30])
def test_small_and_large_commits_are_adopted_alike(make_pool, small_spec, batch):
    spec = small_spec(key_size=13)  # not a multiple of 8: the padded key words
    a = make_pool(pool_size=64 * MiB)
    reg = a.register(spec, 1, 1 * MiB, "engine")
    keys = b"".join(i.to_bytes(13, "big") for i in range(1, batch + 1))
    res = a.reserve_store(reg.namespace_id, reg.client_id, keys)
    a.commit_store(reg.namespace_id, res.store_id, 0)
    b = make_pool(pool_size=64 * MiB)
    assert b.adoption.adopted_blocks == batch and not b.adoption.discarded
    reg2 = b.register(spec, 1, 1 * MiB, "again")
    assert b.lookup(reg2.namespace_id, [keys]) == [batch]
    check_invariants(b)


def test_slots_reserved_at_death_stay_withheld_across_restarts_while_their_engine_lives(
    pair, small_spec, monkeypatch
):
    """Kills in quick succession, hours apart: a slot reserved before an earlier death stays
    out as long as its engine may still write it, and comes free once that engine is dead."""
    first, again = pair
    a, reg = first()
    in_flight = store(a, reg, 3, commit=False)
    b = again()
    assert set(b._namespaces[reg.namespace_id].withheld.tolist()) == set(in_flight)  # noqa: SLF001
    assert b._namespaces[reg.namespace_id].withheld_owners.tolist() == [reg.engine]  # noqa: SLF001
    real = time.time
    monkeypatch.setattr("kvoffload_sidecar.pool.time.time", lambda: real() + 86400)
    c = again()  # restarted once more, a day later
    assert c.adoption.discarded == {"reserved": 1}
    assert set(c._namespaces[reg.namespace_id].withheld.tolist()) == set(in_flight)  # noqa: SLF001
    reg3 = reregister(c, small_spec())
    assert not set(store(c, reg3, *range(10, 16))) & set(in_flight)
    c.locks.kill(reg.engine)
    assert c.reclaim_dead_engines() == 1
    assert set(store(c, reg3, 20)) == set(in_flight)  # free once its owner is gone
    check_invariants(c)


def test_adoption_keeps_the_lru_order_of_hits_not_of_commits(pair, small_spec, clock):
    """A prefix committed first and hit ever since is the most recently used block: after a
    restart it must not be the first victim (the fault drill found it was)."""
    first, again = pair
    a, reg = first()
    store(a, reg, 1)  # the hot prefix, committed first
    store(a, reg, *range(2, 9))  # the pool is full (8 slots)
    pin = a.reserve_load(reg.namespace_id, reg.client_id, pack(1))
    a.release(reg.namespace_id, reg.client_id, [pin.pin_id])
    assert a.lookup(reg.namespace_id, [pack(1)]) == [1]
    b = again()
    reg2 = reregister(b, small_spec())
    clock.now += b.settings.detach_grace_s + 0.1  # adopted blocks are evictable again
    assert len(store(b, reg2, 50, 51)) == 2  # two victims: the least recently used
    assert b.lookup(reg2.namespace_id, [pack(1), pack(2), pack(3), pack(4)]) == [1, 0, 0, 1]
    check_invariants(b)
