"""The connector's gRPC client against a real `kvoffload sidecar` process on a Unix socket."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from kvoffload_cli.sidecar_child import SidecarProcess
from kvoffload_connector.common.client import Backoff, PoolClient, PoolUnavailable, RegisterResult
from kvoffload_connector.common.keys import build_spec, chunk_keys, key_size_for, make_key, pack
from kvoffload_connector.worker.engine_lock import EngineLock, lock_offset

from tests.connector.specs import TINY_SPEC

SPEC = TINY_SPEC


@pytest.fixture(params=[True, False], ids=["framed", "grpc"])
def framed(request) -> bool:
    """Each client test runs on the framed session socket and on the gRPC Session stream."""
    return request.param


@pytest.fixture
def sidecar():
    sc = SidecarProcess(pool_size="16Mi")
    sc.start()
    yield sc
    sc.close()


def keys(*ints: int) -> list[bytes]:
    return [make_key(i.to_bytes(32, "big"), 0) for i in ints]


ENGINE = 0x51DE  # the engine these clients belong to; the test process is its one rank
_HELD: list[EngineLock] = []


@pytest.fixture(autouse=True)
def _release_engine_locks():
    yield
    while _HELD:
        _HELD.pop().release()


def hold(reg: RegisterResult) -> RegisterResult:
    """Hold rank 0's engine lock (as its worker does): the sidecar grants reservations only
    while every rank of the engine holds its lock."""
    _HELD.append(EngineLock(reg.regions[0].path, lock_offset(reg.engine_lock_base, ENGINE, 0)))
    return reg


def new_client(*args, **kwargs) -> PoolClient:
    return PoolClient(*args, engine=ENGINE, **kwargs)


def commit(c: PoolClient, reg: RegisterResult, store_id: int, rank: int = 0) -> bool:
    return c.commit_store(reg.namespace_id, store_id, rank, epoch=reg.epoch, engine=reg.engine)


@pytest.mark.process
@pytest.mark.timeout(60)
def test_store_commit_lookup_pin_release(sidecar, framed):
    c = new_client(sidecar.socket, "test/scheduler", rpc_timeout_s=2, framed=framed)
    reg = hold(c.register(SPEC, 1, 8192))
    assert c.transport == ("framed" if framed else "grpc")
    assert reg.regions[0].slot_bytes == 8192 and reg.generation
    assert c.lookup([keys(1, 2, 3)]) == [0]
    res = c.reserve_store(keys(1, 2, 3))
    assert res.store_id and len(res.slots) == 3
    assert c.lookup([keys(1, 2, 3)]) == [0]  # reserved is not visible
    assert commit(c, reg, res.store_id) is True
    assert c.lookup([keys(1, 2, 3), keys(1, 9), keys(9)]) == [3, 1, 0]
    # a report of presence-map misses: counted as misses, never answered from the index
    hits_before = sidecar.stats().namespaces[0].hit_blocks
    assert c.lookup([keys(1, 2, 3)], report_misses=True) == [0]
    assert sidecar.stats().namespaces[0].hit_blocks == hits_before
    again = c.reserve_store(keys(1, 4))
    assert again.decisions[0] == 2 and len(again.slots) == 1  # PRESENT, then NEW
    pin, slots, versions = c.reserve_load(keys(1, 2, 7))
    assert pin and slots == list(res.slots[:2])
    assert len(versions) == 2 and min(versions) >= 2  # the commit's number, per slot
    assert sidecar.stats().namespaces[0].pinned_slots == 2
    c.release([pin])
    assert sidecar.stats().namespaces[0].pinned_slots == 0
    c.close()


@pytest.mark.process
@pytest.mark.timeout(60)
def test_reserve_load_many_pins_each_list_in_one_pipelined_round(sidecar, framed):
    c = new_client(sidecar.socket, "test/scheduler", rpc_timeout_s=2, framed=framed)
    reg = hold(c.register(SPEC, 1, 8192))
    res = c.reserve_store(keys(1, 2, 3, 4))
    commit(c, reg, res.store_id)
    too_many = keys(*range(100, 100 + 65537))  # over the sidecar's per-call limit
    got = c.reserve_load_many([keys(1, 2), keys(3, 9), keys(9), too_many, keys(4)])
    slot = dict(zip((1, 2, 3, 4), res.slots, strict=True))
    assert got[0] is not None and got[0][1] == [slot[1], slot[2]] and got[0][0]
    assert got[1] is not None and got[1][1] == [slot[3]]  # the hit prefix only
    assert got[2] == (0, [], [])  # a miss pins nothing
    assert got[3] is None  # a refused call fails alone (INVALID_ARGUMENT in-stream)...
    assert got[4] is not None and got[4][1] == [slot[4]]  # ...and the calls after it still answer
    assert sidecar.stats().namespaces[0].pinned_slots == 4
    assert sidecar.stats().namespaces[0].lookups == 0  # plain pins are no lookups
    c.release([g[0] for g in got if g and g[0]])
    assert sidecar.stats().namespaces[0].pinned_slots == 0
    # The connector's lookup-and-pin round: the sidecar counts each list as a lookup too.
    both = c.reserve_load_many([keys(1, 2, 9), keys(9)], count_lookup=True)
    ns = sidecar.stats().namespaces[0]
    assert (ns.lookups, ns.hit_blocks, ns.miss_blocks) == (2, 2, 2)
    c.release([g[0] for g in both if g and g[0]])
    c.close()


@pytest.mark.process
@pytest.mark.timeout(60)
def test_session_end_releases_pins(sidecar, framed):
    owner = new_client(sidecar.socket, "test/a", framed=framed)
    reg = hold(owner.register(SPEC, 1, 8192))
    res = owner.reserve_store(keys(5))
    commit(owner, reg, res.store_id)
    pin, _, _ = owner.reserve_load(keys(5))
    assert pin and sidecar.stats().namespaces[0].pinned_slots == 1
    owner.close()  # the stream ends: the sidecar drops this client's pins
    deadline = time.monotonic() + 5
    while sidecar.stats().namespaces[0].pinned_slots and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sidecar.stats().namespaces[0].pinned_slots == 0


@pytest.mark.process
@pytest.mark.timeout(60)
def test_sidecar_away_is_fast_unavailable_then_reconnects(sidecar, framed):
    c = new_client(
        sidecar.socket,
        "test/w",
        rpc_timeout_s=1,
        reconnect_min_s=0.05,
        reconnect_max_s=0.2,
        framed=framed,
    )
    first = hold(c.register(SPEC, 1, 8192))
    sidecar.kill()
    t0 = time.monotonic()
    with pytest.raises(PoolUnavailable):
        c.lookup([keys(1)])
    assert time.monotonic() - t0 < 1.5  # a dead sidecar costs at most one deadline
    deadline = time.monotonic() + 2
    while c.connected and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not c.connected and c.ensure() is False  # still down: no exception, a miss
    sidecar.start()
    deadline = time.monotonic() + 10
    while not c.ensure() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert c.connected and c.registrations == 2
    # The restarted sidecar adopted the pool file: same generation, workers keep their mapping.
    assert c.registration.generation == first.generation
    assert c.lookup([keys(1)]) == [0]
    c.close()


@pytest.mark.process
@pytest.mark.timeout(60)
def test_the_keeper_reattaches_an_idle_client_within_a_second(sidecar, framed):
    """A client nobody calls (an idle engine) registers again on its own once the sidecar is
    back, and finds the blocks the restarted sidecar adopted."""
    c = new_client(sidecar.socket, "test/w", framed=framed, keep_attached=True)
    reg = hold(c.register(SPEC, 1, 8192))
    stored = c.reserve_store(keys(1, 2))
    assert commit(c, reg, stored.store_id) is True
    sidecar.kill()
    sidecar.start()  # returns once the new sidecar serves
    serving = time.monotonic()
    while c.registrations < 2 and time.monotonic() - serving < 5:
        time.sleep(0.01)
    took = time.monotonic() - serving
    assert c.registrations == 2 and c.connected, "the keeper never re-registered"
    assert took < 1.0, f"re-attached {took:.2f} s after the sidecar served again"
    assert c.registration.generation == reg.generation
    assert c.lookup([keys(1, 2)]) == [2]  # the adopted blocks
    c.close()


def _wakes(thread: threading.Thread) -> int:
    """How often `thread` has gone to sleep and been woken (the kernel's count for it)."""
    status = Path(f"/proc/self/task/{thread.native_id}/status").read_text()
    return int(status.split("voluntary_ctxt_switches:")[1].split()[0])


@pytest.mark.process
@pytest.mark.timeout(60)
def test_an_attached_idle_client_does_not_wake_the_engine(sidecar, framed):
    """An idle engine's client threads sleep until something happens: every timer wake takes
    the engine process's GIL, which a prefill's launch thread then has to hand over. The
    keeper waits on the session's end (a sidecar kill wakes it at once, the test above) and
    the framed watcher on its socket, with no timer; `close()` still ends both at once."""
    c = new_client(sidecar.socket, "test/w", framed=framed, keep_attached=True)
    c.register(SPEC, 1, 8192)
    mine = {"kvoffload-keep-attached", "kvoffload-framed-watch"}
    threads = [t for t in threading.enumerate() if t.name in mine and t.is_alive()]
    assert {t.name for t in threads} == (mine if framed else {"kvoffload-keep-attached"})
    time.sleep(0.2)
    before = {t.name: _wakes(t) for t in threads}
    time.sleep(1.5)  # the old keeper woke 7 times in this, the old watcher 3 times
    after = {t.name: _wakes(t) for t in threads}
    assert all(after[n] - before[n] <= 1 for n in before), (before, after)
    assert c.connected
    t0 = time.monotonic()
    c.close()
    for t in threads:
        t.join(timeout=2)
    assert not any(t.is_alive() for t in threads), "a client thread outlived close()"
    assert time.monotonic() - t0 < 1.0


@pytest.mark.process
@pytest.mark.timeout(60)
def test_close_ends_the_framed_watcher_while_a_forked_child_lives(sidecar):
    """vLLM forks its workers after the scheduler's client exists: the child inherits the
    watcher's wake pipe, so closing the write end alone never wakes the parent's watcher;
    the byte down the pipe does."""
    c = new_client(sidecar.socket, "test/s", framed=True)
    c.register(SPEC, 1, 8192)
    watcher = next(t for t in threading.enumerate() if t.name == "kvoffload-framed-watch")
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,))
    child.start()
    try:
        c.close()
        watcher.join(timeout=2)
        assert not watcher.is_alive(), "the framed watcher outlived close() beside a forked child"
    finally:
        child.kill()
        child.join()


@pytest.mark.process
@pytest.mark.timeout(60)
def test_a_dead_sidecar_is_noticed_without_a_call(sidecar, framed):
    """A worker may make no call for a long time (stores of a stale pool generation fail
    locally): the client must still see the session end, so `ensure()` re-registers."""
    c = new_client(sidecar.socket, "test/w", reconnect_min_s=0.05, framed=framed)
    c.register(SPEC, 1, 8192)
    assert c.connected
    sidecar.kill()
    deadline = time.monotonic() + 5
    while c.connected and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not c.connected
    sidecar.start()
    deadline = time.monotonic() + 10
    while not c.ensure() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert c.connected and c.registrations == 2
    c.close()


def _freeze(pid: int) -> None:
    """SIGSTOP `pid` and wait until the kernel shows it stopped: the signal is delivered
    asynchronously, and a sidecar still running for a moment answers the next call (a CI run
    saw a lookup answered after the signal was sent)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "T":
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.005)


@pytest.mark.process
@pytest.mark.timeout(60)
def test_a_silent_sidecar_costs_one_deadline_then_the_session_is_replaced(sidecar, framed):
    """The caller reads its own answers; the watchdog ends an exchange at its deadline."""
    c = new_client(
        sidecar.socket,
        "test/w",
        rpc_timeout_s=0.3,
        reconnect_min_s=0.05,
        reconnect_max_s=0.2,
        framed=framed,
    )
    reg = hold(c.register(SPEC, 1, 8192))
    res = c.reserve_store(keys(1))
    commit(c, reg, res.store_id)
    time.sleep(1.3)  # no call for over a second: the watchdog sleeps until the next one
    _freeze(sidecar.proc.pid)  # alive but silent (a stuck process)
    try:
        t0 = time.monotonic()
        with pytest.raises(PoolUnavailable, match="no answer within 300 ms"):
            c.lookup([keys(1)])
        waited = time.monotonic() - t0
        assert 0.3 <= waited < 1.0, waited
        assert not c.connected  # that session is given up...
        with pytest.raises(PoolUnavailable):
            c.reserve_load(keys(1))  # ...at once, no second deadline
    finally:
        sidecar.proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 10
    while not c.ensure() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert c.registrations == 2 and c.lookup([keys(1)]) == [1]  # same pool: the block is there
    c.close()


@pytest.mark.process
@pytest.mark.timeout(60)
def test_calls_from_several_threads_each_get_their_own_answer(sidecar, framed):
    c = new_client(sidecar.socket, "test/w", rpc_timeout_s=5, framed=framed)
    reg = hold(c.register(SPEC, 1, 8192))
    res = c.reserve_store(keys(*range(1, 9)))
    commit(c, reg, res.store_id)
    errors: list[BaseException] = []

    def hammer(n: int) -> None:
        try:
            for _ in range(200):
                assert c.lookup([keys(*range(1, n + 1)), keys(99)]) == [n, 0]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=hammer, args=(n,)) for n in (1, 4, 8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    c.close()


def test_backoff_doubles_and_resets():
    now = [0.0]
    b = Backoff(0.1, 0.4, clock=lambda: now[0])
    assert b.due()
    for expected in (0.1, 0.2, 0.4, 0.4):  # doubling, capped at the maximum
        start = now[0]
        b.failed()
        now[0] = start + expected - 0.001
        assert not b.due()
        now[0] = start + expected
        assert b.due()
    b.failed()
    b.reset()
    assert b.due()


def test_keys_pack_chunk_last_block_hash_and_group():
    hashes = [bytes([i]) * 32 for i in range(5)]
    ks = chunk_keys(hashes, 2, group=1)
    assert ks == [hashes[1] + b"\x00\x00\x00\x01", hashes[3] + b"\x00\x00\x00\x01"]
    assert key_size_for("sha256") == 36 and key_size_for("xxhash") == 20
    assert pack(ks, 36) == b"".join(ks)
    with pytest.raises(ValueError, match="36"):
        pack([b"short"], 36)
    with pytest.raises(ValueError, match="md5"):
        key_size_for("md5")


def test_spec_changes_with_anything_that_changes_bytes():
    base = dict(
        model="m",
        dtype="bfloat16",
        kv_layout="LB",
        block_size=16,
        chunk_blocks=4,
        tp_size=1,
        hash_algo="sha256",
        group_specs=["Full:w0"],
    )
    a = build_spec(**base)
    assert a == build_spec(**base)
    for k, v in [
        ("dtype", "fp8_e4m3"),
        ("tp_size", 2),
        ("group_specs", ["Full:w0", "SW:w32"]),
        ("chunk_blocks", 8),
    ]:
        assert build_spec(**{**base, k: v}).to_proto() != a.to_proto(), k
