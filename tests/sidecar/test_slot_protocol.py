"""The slot protocol (docs/POOL.md, "Invariant: a load copies only bytes stored for its key"):
load versions, store ownership by engine with real file locks, fenced commits.

In-process `Pool`s over a real pool file on tmpfs; the engine locks are real OFD locks, held
by this process or by a child process that is killed (the kernel drops its locks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from kvoffload_connector.worker.engine_lock import EngineLock, lock_offset
from kvoffload_connector.worker.slot_versions import SlotVersions
from kvoffload_sidecar.errors import FailedPrecondition
from kvoffload_sidecar.pool import Pool, Registration, StoreDecision
from pool_invariants import check_invariants

MiB = 1 << 20
NEW, NO_SPACE = StoreDecision.NEW, StoreDecision.NO_SPACE
ENGINE = 0x2A5


def pack(*ints: int) -> bytes:
    return b"".join(i.to_bytes(8, "big") for i in ints)


def locks_of(pool: Pool, reg: Registration, ranks: int = 1) -> list[EngineLock]:
    """This process as every rank of the registration's engine."""
    path = reg.regions[0].path
    return [
        EngineLock(path, lock_offset(reg.engine_lock_base, reg.engine, r)) for r in range(ranks)
    ]


def versions_view(reg: Registration) -> SlotVersions:
    """What a worker maps: the namespace's slot table, from the registration's answer."""
    r = reg.regions[0]
    return SlotVersions(r.path, reg.slot_table_offset, reg.slot_record_bytes, r.slot_count)


@pytest.fixture
def real_pool(make_pool):
    """A pool probing engine liveness with F_OFD_GETLK on its file (the shipped default)."""
    return make_pool(liveness=None, detach_grace_s=0.0)


def register(pool: Pool, small_spec, engine: int = ENGINE, tp: int = 1) -> Registration:
    return pool.register(small_spec(tp_size=tp), tp, 1 * MiB, "engine/scheduler", engine)


# -- class 1: a load checks its slots' versions after the copy --------------------------------


def test_a_pin_answers_each_slots_version_and_a_rewrite_changes_it(real_pool, small_spec):
    reg = register(real_pool, small_spec)
    held = locks_of(real_pool, reg)
    ns = reg.namespace_id
    res = real_pool.reserve_store(ns, reg.client_id, pack(1, 2))
    real_pool.commit_store(ns, res.store_id, 0, epoch=reg.sidecar_epoch, engine=ENGINE)
    pin = real_pool.reserve_load(ns, reg.client_id, pack(1, 2))
    view = versions_view(reg)
    assert list(pin.versions) == view._state[list(pin.slots)].tolist()  # noqa: SLF001
    assert set(pin.versions) == {pin.versions[0]} and pin.versions[0] >= 2  # one commit's
    assert view.matches(list(pin.slots), list(pin.versions))
    # the pin ends (its session died); eviction takes key 1 and a store re-reserves its slot
    real_pool.release(ns, reg.client_id, [pin.pin_id])
    table = real_pool._namespaces[ns].table  # noqa: SLF001
    real_pool._drop_victims(real_pool._namespaces[ns], [pack(1)])  # noqa: SLF001
    # eviction writes nothing: the bytes and the version are intact
    assert view.matches(list(pin.slots), list(pin.versions))
    again = real_pool.reserve_store(ns, reg.client_id, pack(9))
    assert list(again.slots) == [pin.slots[0]]  # the freed slot, reused
    assert int(table.state[pin.slots[0]]) == 1  # reserved before the answer left
    assert not view.matches(list(pin.slots), list(pin.versions))  # a load of it now fails
    real_pool.commit_store(ns, again.store_id, 0, epoch=reg.sidecar_epoch, engine=ENGINE)
    assert not view.matches(list(pin.slots), list(pin.versions))  # and after the commit
    assert int(table.state[pin.slots[0]]) > max(pin.versions)  # never an old value again
    view.close()
    for lock in held:
        lock.release()


# -- class 2: a reservation belongs to its engine, reclaimed only once it is dead --------------


def test_no_reservation_for_an_engine_whose_ranks_hold_no_lock(real_pool, small_spec):
    reg = register(real_pool, small_spec, tp=2)
    ns = reg.namespace_id
    assert real_pool.reserve_store(ns, reg.client_id, pack(1)).decisions == (NO_SPACE,)
    one = locks_of(real_pool, reg, ranks=1)  # rank 1 has no lock yet: it could write unseen
    assert real_pool.reserve_store(ns, reg.client_id, pack(1)).decisions == (NO_SPACE,)
    both = locks_of(real_pool, reg, ranks=2)
    assert real_pool.reserve_store(ns, reg.client_id, pack(1)).decisions == (NEW,)
    (stats,) = real_pool.stats().namespaces
    assert stats.unlocked_reservations == 2
    for lock in one + both:
        lock.release()


HOLDER = textwrap.dedent(
    """
    import sys, time
    from kvoffload_connector.worker.engine_lock import EngineLock
    lock = EngineLock(sys.argv[1], int(sys.argv[2]))
    print("held", flush=True)
    time.sleep(600)
    """
)


def test_a_late_copy_after_session_loss_cannot_reach_a_slot_given_to_another_store(
    real_pool, small_spec
):
    """The engine's session ends (its client is forgotten at once here) while its worker, a
    real child process holding its rank's lock, may still be copying: the reserved slot stays
    the engine's however long; once the worker is killed, the kernel drops its lock and the
    slot is free for another store."""
    reg = register(real_pool, small_spec)
    ns = reg.namespace_id
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            HOLDER,
            reg.regions[0].path,
            str(lock_offset(reg.engine_lock_base, ENGINE, 0)),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        res = real_pool.reserve_store(ns, reg.client_id, pack(*range(1, 9)))  # the whole pool
        assert res.decisions == (NEW,) * 8
        real_pool.attach(reg.client_id)
        real_pool.detach(reg.client_id)  # the session ended (a deadline, a restart)
        real_pool.reap_idle_clients()
        other = register(real_pool, small_spec, engine=ENGINE + 1)
        held = locks_of(real_pool, other)
        for _ in range(3):  # reaper ticks: the worker still holds its lock
            real_pool.reap_idle_clients()
            assert real_pool.reserve_store(ns, other.client_id, pack(100)).decisions == (NO_SPACE,)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        assert real_pool.reclaim_dead_engines() == 8
        got = real_pool.reserve_store(ns, other.client_id, pack(100))
        assert got.decisions == (NEW,) and got.slots[0] in set(res.slots)
        check_invariants(real_pool)
        for lock in held:
            lock.release()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)


def test_a_reregistered_client_of_the_same_engine_finishes_its_reservations(make_pool, small_spec):
    pool = make_pool(detach_grace_s=0.0)
    reg = register(pool, small_spec)
    ns = reg.namespace_id
    res = pool.reserve_store(ns, reg.client_id, pack(1))
    pool.attach(reg.client_id)
    pool.detach(reg.client_id)  # forgotten at once: the reservation is the engine's
    again = register(pool, small_spec)  # same engine, a new session
    assert pool.commit_store(ns, res.store_id, 0, epoch=again.sidecar_epoch, engine=ENGINE)
    assert pool.lookup(ns, [pack(1)]) == [1]
    check_invariants(pool)


# -- fenced commits -------------------------------------------------------------------------


def test_a_commit_naming_another_sidecar_instance_or_engine_is_refused(make_pool, small_spec):
    pool = make_pool()
    reg = register(pool, small_spec)
    ns = reg.namespace_id
    res = pool.reserve_store(ns, reg.client_id, pack(1))
    with pytest.raises(FailedPrecondition, match="sidecar instance"):
        pool.commit_store(ns, res.store_id, 0, epoch=reg.sidecar_epoch ^ 1, engine=ENGINE)
    with pytest.raises(FailedPrecondition, match="belongs to"):
        pool.commit_store(ns, res.store_id, 0, epoch=reg.sidecar_epoch, engine=ENGINE + 1)
    with pytest.raises(FailedPrecondition):
        pool.abort_store(ns, res.store_id, epoch=reg.sidecar_epoch, engine=ENGINE + 1)
    assert pool.lookup(ns, [pack(1)]) == [0]  # nothing became visible
    (stats,) = pool.stats().namespaces
    assert stats.refused_commits == 3 and stats.reserved_slots == 1
    assert pool.commit_store(ns, res.store_id, 0, epoch=reg.sidecar_epoch, engine=ENGINE)
    assert pool.lookup(ns, [pack(1)]) == [1]


def test_a_restarted_sidecar_refuses_the_dead_instances_commit(make_pool, small_spec):
    """The reservation died with its sidecar: its slot stays withheld (the engine lives) and
    a late commit naming the dead instance makes nothing visible."""
    first = make_pool()
    reg = register(first, small_spec)
    ns = reg.namespace_id
    res = first.reserve_store(ns, reg.client_id, pack(1))
    second = make_pool()  # adopts the file (the first never runs again)
    assert second.epoch != first.epoch and second.generation == first.generation
    again = register(second, small_spec)
    with pytest.raises(FailedPrecondition, match="sidecar instance"):
        second.commit_store(ns, res.store_id, 0, epoch=reg.sidecar_epoch, engine=ENGINE)
    assert second.lookup(ns, [pack(1)]) == [0]
    withheld = second._namespaces[ns].withheld  # noqa: SLF001
    assert withheld.tolist() == list(res.slots)
    assert np.asarray(second._namespaces[ns].withheld_owners).tolist() == [ENGINE]  # noqa: SLF001
    got = second.reserve_store(ns, again.client_id, pack(*range(10, 20)))
    assert not set(got.slots) & set(res.slots)  # never handed out while its engine lives


def test_a_discarded_file_takes_no_store_while_a_worker_of_its_old_contents_holds_a_lock(
    pool_dir, small_spec
):
    from kvoffload_sidecar import persist
    from kvoffload_sidecar.pool import PoolSettings

    settings = PoolSettings(
        pool_size=8 * MiB + (16 << 10), pool_dir=pool_dir, prefault_chunk_bytes=MiB
    )
    first = Pool(settings)
    first.start()
    reg = register(first, small_spec)
    old_worker = locks_of(first, reg)  # maps the old contents, may still copy into them
    buf = first.region.buffer
    at = first._geometry.header_offset  # noqa: SLF001
    buf[at + 8 : at + 12] = (persist.FORMAT_VERSION + 7).to_bytes(4, "little")  # unreadable
    second = Pool(settings)
    try:
        second.start()
        assert second.adoption.outcome == "discarded"
        assert second.generation != first.generation
        # every slot behind the new pre-fault: a refusal below is the old worker's lock, never
        # a slot not ready yet (the pre-fault runs in its own thread)
        assert second.wait_ready(30)
        assert second.stats().pool_ready
        fresh = register(second, small_spec, engine=ENGINE + 1)
        new_worker = locks_of(second, fresh)
        ns = fresh.namespace_id
        assert second.reserve_store(ns, fresh.client_id, pack(1)).decisions == (NO_SPACE,)
        for lock in old_worker:  # drained (re-mapped) or exited
            lock.release()
        assert second.reserve_store(ns, fresh.client_id, pack(1)).decisions == (NEW,)
        for lock in new_worker:
            lock.release()
    finally:
        second.close()
        first.close()
        os.sync()
