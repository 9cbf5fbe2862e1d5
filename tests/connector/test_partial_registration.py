"""A rank attaching to a big pool serves hits from the pieces it has registered so far.

Each worker rank page-locks its mapping in pieces on a background thread, each piece only once
the pool owner's pre-fault has passed it; `PoolView.usable_end` says how far it got. The ranks
report it (handshake metadata, step reports), and the scheduler plans loads only for chunks
whose slots lie below every rank's end: a hit past it is a miss, never waited for and never
copied, and a store reserved past it is aborted before any copy.

The device registration here is a stand-in for cudaHostRegister that registers one piece each
time the test lets it (no GPU on this machine); the pool is the sidecar's real `Pool` and gRPC
server on its socket, in this process so that its pre-fault can be walked chunk by chunk
(`PrefaultGate`); the copies are the CPU engine's, through the rank's own mapping of the pool.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from kvoffload_connector.common.client import PoolClient
from kvoffload_connector.common.config import parse_extra_config
from kvoffload_connector.common.keys import build_spec
from kvoffload_connector.common.metadata import (
    ConnectorMeta,
    GroupTransfer,
    LoadJob,
    PoolHandshake,
    Registration,
    StoreJob,
    WorkerReport,
)
from kvoffload_connector.worker import pool_view
from kvoffload_connector.worker.layout import canonicalize
from kvoffload_connector.worker.offload_worker import OffloadWorker
from kvoffload_connector.worker.pool_pieces import PrefaultState, ServerPrefault
from kvoffload_connector.worker.pool_view import PoolView

from tests.connector.kv_setup import expected_block, fill_random, make_kv_caches, write_block
from tests.connector.test_scheduler import ask, commit_prompt, make, settle
from tests.connector.vllm_fakes import KVBlocks, Request, SchedOut
from tests.sidecar.procs import ServerThread, server_config, short_dir

PAGE = mmap.ALLOCATIONGRANULARITY
CHUNK_BLOCKS = 4
ENGINE = 777


class StepRegistrar:
    """cudaHostRegister as the test lets it: each `register` waits for one `allow()`. It
    records every range it registered and unregistered, and (`probe`) what the test wants to
    know at the moment a piece is registered."""

    def __init__(self, probe=lambda ptr, nbytes: None) -> None:
        self._allowed = threading.Semaphore(0)
        self.calls: list[tuple[int, int]] = []
        self.seen: list[object] = []
        self.unregistered: list[int] = []
        self._probe = probe
        self._done = threading.Condition()

    def allow(self, n: int = 1) -> None:
        for _ in range(n):
            self._allowed.release()

    def register(self, ptr: int, nbytes: int) -> None:
        assert self._allowed.acquire(timeout=30), "the test never let this piece through"
        with self._done:
            self.seen.append(self._probe(ptr, nbytes))
            self.calls.append((ptr, nbytes))
            self._done.notify_all()

    def unregister(self, ptr: int) -> None:
        self.unregistered.append(ptr)

    def wait_for(self, n: int, timeout_s: float = 10.0) -> bool:
        with self._done:
            return self._done.wait_for(lambda: len(self.calls) >= n, timeout_s)


def wait_until(cond, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


@pytest.fixture
def pool_file(tmp_path):
    base = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    path = os.path.join(base, f"kvoffload-pieces-{os.getpid()}-{id(tmp_path)}.shm")
    with open(path, "wb") as f:
        f.truncate(64 * PAGE)
    yield path
    os.unlink(path)


# -- the mapping: usable end, piece by piece ---------------------------------------------------


def test_the_usable_end_grows_piece_by_piece_and_never_moves_back(pool_file, monkeypatch):
    monkeypatch.setattr(pool_view, "REGISTER_PIECE_BYTES", 2 * PAGE)
    view = PoolView.open(pool_file, 0, PAGE // 2, 100)  # pieces of 4 slots: 25 of them
    pieces = view.pieces()
    assert len(pieces) == 25 and pieces[0] == (0, 4)
    reg = StepRegistrar()
    view.start_device_registration(torch.device("cpu"), reg)
    seen = [view.usable_end]
    assert seen == [0] and not view.ready and view.registered_end == 0
    for n, (_, end) in enumerate(pieces, 1):
        time.sleep(0.002)
        assert view.usable_end == seen[-1]  # no piece registered without the device's word
        reg.allow()
        assert reg.wait_for(n)
        wait_until(lambda e=end: view.usable_end == e)
        seen.append(view.usable_end)
        assert view.ready == (n == len(pieces))
        assert view.registered_bytes == end * view.slot_bytes
    assert view.wait_ready(5) and view.ready and view.registered
    assert [e for _, e in view.progress] == [e for _, e in pieces] == seen[1:]
    assert seen == sorted(seen) and seen[-1] == 100  # monotonic, from 0 to every slot
    assert [ptr - view.base_ptr for ptr, _ in reg.calls] == [f * PAGE // 2 for f, _ in pieces]
    assert all(n == 2 * PAGE for _, n in reg.calls)
    ptrs = [p for p, _ in reg.calls]
    view.close()
    assert view.usable_end == 0 and reg.unregistered == ptrs  # every piece, once


def test_a_cpu_view_without_a_registration_is_usable_whole(pool_file):
    view = PoolView.open(pool_file, 0, PAGE, 8)
    view.start_device_registration(torch.device("cpu"))
    assert view.usable_end == 8 and view.ready and view.registered_end == 0
    view.close()


class Frontier:
    """The owner's pre-fault as a PrefaultWatch: slots [0, n) pre-faulted."""

    def __init__(self) -> None:
        self.slots = 0
        self.asked: list[int] = []

    def passed(self, end_slot: int) -> bool:
        self.asked.append(end_slot)
        return end_slot <= self.slots


def test_a_piece_is_registered_only_once_the_owner_prefault_passed_it(pool_file, monkeypatch):
    monkeypatch.setattr(pool_view, "REGISTER_PIECE_BYTES", 2 * PAGE)
    view = PoolView.open(pool_file, 0, PAGE, 10)  # pieces of 2 slots
    frontier = Frontier()
    reg = StepRegistrar(probe=lambda ptr, nbytes: frontier.slots)
    reg.allow(100)  # the device would register at once: only the pre-fault holds it back
    view.start_device_registration(torch.device("cpu"), reg, frontier)
    try:
        time.sleep(0.3)
        assert reg.calls == [] and view.usable_end == 0 and frontier.asked  # it waits
        frontier.slots = 3  # the pre-fault passed slot 2 (piece 0), not piece 1's end (4)
        wait_until(lambda: view.usable_end == 2)
        time.sleep(0.2)
        assert len(reg.calls) == 1 and view.usable_end == 2
        frontier.slots = 10
        assert view.wait_ready(5)
        # every piece was registered behind the frontier at that moment
        for (ptr, nbytes), at in zip(reg.calls, reg.seen, strict=True):
            assert (ptr - view.base_ptr + nbytes) // PAGE <= at
    finally:
        view.close()


def test_a_view_closed_while_waiting_for_the_prefault_stops_at_once(pool_file):
    view = PoolView.open(pool_file, 0, PAGE, 10)
    reg = StepRegistrar()
    view.start_device_registration(torch.device("cpu"), reg, Frontier())
    t0 = time.monotonic()
    view.close()
    assert time.monotonic() - t0 < 2 and reg.calls == [] and view.usable_end == 0


def test_the_pools_prefault_is_asked_at_a_bounded_rate_and_a_failed_ask_is_no_progress():
    now = [0.0]
    answers: list[object] = [RuntimeError("away"), PrefaultState(False, 4), PrefaultState(True)]

    def ask_pool() -> PrefaultState:
        got = answers.pop(0)
        if isinstance(got, Exception):
            raise got
        return got

    watch = ServerPrefault(PrefaultState(False, 0), ask_pool, interval_s=0.25, clock=lambda: now[0])
    assert not watch.passed(2) and watch.asks == 1  # the pool did not answer: wait
    for _ in range(50):  # polled again and again within the interval: not asked again
        assert not watch.passed(2)
    assert watch.asks == 1
    now[0] += 0.3
    assert watch.passed(2) and watch.asks == 2  # 4 slots pre-faulted
    assert watch.passed(4) and watch.asks == 2  # known already: no ask
    assert not watch.passed(5) and watch.asks == 2  # within the interval
    now[0] += 0.3
    assert watch.passed(1 << 30) and watch.asks == 3  # the whole pool
    assert ServerPrefault(PrefaultState(True), ask_pool).passed(1 << 30)


# -- the scheduler: loads below every rank's end, the rest misses; stores past it aborted ------


def test_loads_are_planned_only_below_every_ranks_registered_end():
    """Two ranks; the prompt's chunks sit in slots 100..103. A rank that registered up to slot
    102 lets the first two chunks load; the other two are misses (recomputed by vLLM) and are
    never waited for, even with a long `ready_wait_ms`."""
    s, fake, bp, _ = make(world=2, ready_wait_ms=60_000)
    s.update_connector_output(WorkerReport(ready={0: True, 1: False}, usable={0: 500, 1: 102}))
    req = Request("r", list(range(300)))
    commit_prompt(fake, req, 4)
    assert ask(s, req) == (128, True)  # chunks 0 and 1 (slots 100, 101)
    blocks = bp.allocate(10)
    s.update_state_after_alloc(req, KVBlocks((blocks,)), 128)
    (job,) = s.build_connector_meta(SchedOut({})).loads
    assert set(job.transfers[0].slots) == {100, 101}
    assert s.unregistered_hit_chunks == 2
    s.update_connector_output(WorkerReport(done={job.job_id: 2}))
    settle(s)
    assert fake.pins == {}
    # the lower rank's end is the limit: rank 0 going back (a new mapping) cuts every hit
    s.update_connector_output(WorkerReport(ready={0: False}, usable={0: 100}))
    req2 = Request("r2", list(range(300)))
    commit_prompt(fake, req2, 4)
    assert ask(s, req2) == (0, False)  # every chunk past it: a miss, never waited for
    settle(s)
    assert fake.pins == {}  # its pins went back
    # once every rank registered everything, the whole hit loads
    s.update_connector_output(WorkerReport(ready={0: True, 1: True}, usable={0: 500, 1: 500}))
    assert ask(s, Request("r3", list(range(300)))) == (256, True)


def test_a_rank_with_no_piece_yet_is_not_ready_and_a_hit_waits_for_it():
    """Nothing registered on a rank yet (its first piece takes ~0.1 s): as before, a hit waits
    (bounded by ready_wait_ms) and a miss does not; the first piece lets it load."""
    s, fake, *_ = make(world=2, ready_wait_ms=10_000)
    s.update_connector_output(WorkerReport(ready={0: True, 1: False}, usable={0: 500, 1: 0}))
    req = Request("hit", list(range(300)))
    commit_prompt(fake, req, 4)
    assert s.get_num_new_matched_tokens(req, 0) == (None, False)
    s.build_connector_meta(SchedOut({}))
    settle(s)
    assert s.get_num_new_matched_tokens(req, 0) == (None, False)
    s.update_connector_output(WorkerReport(usable={1: 104}))
    assert ask(s, req) == (256, True)


def test_the_handshake_tells_the_ranks_registered_ends_before_any_step():
    s, fake, *_ = make(world=2)
    s.on_handshake({}, {0: (True, 500), 1: (False, 101)})
    req = Request("r", list(range(300)))
    commit_prompt(fake, req, 4)
    assert ask(s, req) == (64, True)  # only slot 100 lies below rank 1's end
    reg = Registration(None, 2, 4096, "ns", "gen-1")
    assert PoolHandshake(reg).usable_end == 0  # a handshake that says nothing: none usable


def test_a_store_reserved_past_a_ranks_registered_end_is_aborted_never_sent():
    s, fake, bp, mgr = make(world=2)
    s.update_connector_output(WorkerReport(ready={0: False, 1: True}, usable={0: 20, 1: 500}))
    fake.next_slot = 50  # the pool hands out slots past rank 0's registered pieces
    req = Request("r", list(range(200)))
    ask(s, req)
    blocks = bp.allocate(7)
    mgr.req_blocks["r"] = [blocks]
    s.build_connector_meta(SchedOut({"r": 200}))
    settle(s)
    meta = s.build_connector_meta(SchedOut({}))
    settle(s)
    assert fake.calls.count("reserve_store") == 1
    assert meta.stores == () and fake.aborted == [7]  # freed, nothing committed, no copy
    assert all(b.ref_cnt == 1 for b in blocks) and not s.has_pending_work()
    assert s.unregistered_store_chunks == 3
    # below the end: the store goes out as usual
    fake.next_slot = 0
    req2 = Request("r2", list(range(1000, 1200)))
    ask(s, req2)
    mgr.req_blocks["r2"] = [bp.allocate(7)]
    s.build_connector_meta(SchedOut({"r2": 200}))
    settle(s)
    (job,) = s.build_connector_meta(SchedOut({})).stores
    assert set(job.transfers[0].slots) == {0, 1, 2}


# -- a worker rank on a real pool: behind its pre-fault, copies only what is registered --------


@pytest.fixture
def gated_pool(tmp_path):
    """The sidecar's Pool and gRPC server on a socket, its pre-fault walked by the test."""
    from kvoffload_sidecar.pool import Pool
    from kvoffload_sidecar.region import PrefaultGate
    from kvoffload_sidecar.runtime import pool_settings

    sock_dir = short_dir()
    pool_dir = tmp_path / "pool"
    pool_dir.mkdir()
    cfg = server_config(pool_dir, sock_dir, pool_size=16 << 20)
    gate = PrefaultGate()
    srv = ServerThread(cfg)
    srv.pool = Pool(
        dataclasses.replace(pool_settings(cfg), prefault_chunk_bytes=1 << 20), prefault_gate=gate
    )
    with srv:
        yield SimpleNamespace(server=srv, gate=gate, socket=str(cfg.socket))
        gate.close()


def make_worker(socket_path: str) -> tuple[OffloadWorker, object]:
    setup = make_kv_caches("LBHNC", num_blocks=24)
    layout = canonicalize(setup.kv_caches, setup.layer_groups, CHUNK_BLOCKS, setup.kv_cache_config)
    fill_random(layout, seed=5)
    cfg = parse_extra_config({"socket": socket_path}, block_size=4)
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, pipeline_parallel_size=1, world_size=1
        ),
        cache_config=SimpleNamespace(block_size=4),
    )
    w = OffloadWorker(cfg, vllm_config=vllm_config, kv_cache_config=None, rank=0)
    w.layout, w.device = layout, torch.device("cpu")
    w.spec = build_spec(
        model="pieces-test",
        dtype="float32",
        kv_layout=layout.tag,
        block_size=4,
        chunk_blocks=CHUNK_BLOCKS,
        tp_size=1,
        hash_algo="sha256",
        group_specs=("full",),
    )
    return w, setup


def prefaulted_slots(pool) -> int:
    (ns,) = pool.stats().namespaces
    return ns.prefaulted_slots


class RecordingEngine:
    """The rank's CPU engine, with the slots of every job submitted to it recorded."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.slots: list[int] = []

    def submit(self, job_id, direction, batches):
        self.slots += [int(s) for b in batches for s in b.slots]
        return self._engine.submit(job_id, direction, batches)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_a_rank_registers_behind_the_prefault_and_copies_only_registered_slots(
    gated_pool, monkeypatch
):
    """The rank maps its region of a pool whose pre-fault has not started; each piece is
    registered only once the pool's pre-fault passed it (read from its Stats), the usable end
    reaches the scheduler in the step reports, and a load or a store naming a slot past it is
    failed before any copy (the scheduler then aborts the store: nothing is committed), while
    slots below it store and load byte for byte."""
    pool = gated_pool.server.pool
    w, setup = make_worker(gated_pool.socket)
    slot_bytes = w.layout.slot_bytes
    monkeypatch.setattr(pool_view, "REGISTER_PIECE_BYTES", 2 * max(slot_bytes, PAGE))
    reg = StepRegistrar(probe=lambda ptr, nbytes: prefaulted_slots(pool))
    reg.allow(1000)  # the device registers at once: only the pre-fault holds it back
    w.registrar = lambda device: reg
    try:
        answer = w.client.register(w.spec, 1, slot_bytes)
        assert not answer.pool_ready
        w._apply(answer)
        view = w.pool
        per_piece = view.pieces()[0][1]
        time.sleep(0.5)
        assert reg.calls == [] and w.usable_end == 0 and not w.ready  # nothing pre-faulted
        first = w.report()
        assert first is not None and first.usable == {0: 0} and first.ready == {0: False}
        assert w.no_pool_reason() == "registering the pool with the device"
        # the pre-fault walks chunk by chunk; every piece waits for it
        while prefaulted_slots(pool) < max(per_piece, view.slot_count * 3 // 10):
            gated_pool.gate.step(1)
        behind = max(e for _, e in view.pieces() if e <= prefaulted_slots(pool))
        wait_until(lambda: w.usable_end == behind)
        grown = w.report()
        assert grown is not None and grown.usable[0] >= per_piece and grown.ready == {0: False}
        assert w.report() is None  # said once per change
        end = w.usable_end
        assert 0 < end < view.slot_count
        tenths = end * 10 // view.slot_count  # what the status says: how far, in tenths
        assert 3 <= tenths < 10
        assert w.no_pool_reason() == (
            f"registering the pool with the device: {tenths * 10}% of "
            f"{view.slot_count * slot_bytes / 1e9:.1f} GB so far, loads and stores use that part"
        )
        ns, gen = answer.namespace_id, answer.generation
        w.start_load_kv(ConnectorMeta(engine=ENGINE))  # the engine lock, as a step takes it
        engine = w.engine = RecordingEngine(w.engine)
        # a store into a slot past the registered end fails before any copy
        beyond = view.slot_count - 1
        far = StoreJob(1, 11, ns, (GroupTransfer(0, (0, 1), (beyond,) * 2, (0, 1)),), gen, 0,
                       ENGINE)  # fmt: skip
        w.wait_for_save(ConnectorMeta(stores=(far,), engine=ENGINE))
        report = w.report()
        assert report is not None and report.failed == {1: 1} and engine.slots == []
        # below it: a real store through the pool's reservation, then a load, byte for byte
        sched = PoolClient(gated_pool.socket, "pieces/scheduler", rpc_timeout_s=5, engine=ENGINE)
        sched.register(w.spec, 1, slot_bytes)
        res = sched.reserve_store([bytes([7]) * 36])
        assert res.store_id and res.slots[0] < end
        store = StoreJob(2, res.store_id, ns, (GroupTransfer(0, (0, 1, 2, 3), (res.slots[0],) * 4,
                         (0, 1, 2, 3)),), gen, sched.registration.epoch, ENGINE)  # fmt: skip
        w.wait_for_save(ConnectorMeta(stores=(store,), engine=ENGINE))
        wait_until(lambda: w.client.lookup([[bytes([7]) * 36]])[0] == 1)
        want = [expected_block(setup, w.layout, 0, b) for b in range(4)]
        for b in range(4):
            write_block(setup, w.layout, 0, b, np.zeros_like(want[b]))
        pin = w.client.reserve_load([bytes([7]) * 36])
        load = LoadJob(3, "near", (GroupTransfer(0, (8, 9, 10, 11), (pin.slots[0],) * 4,
                       (0, 1, 2, 3)),), gen, versions=((pin.versions[0],) * 4,))  # fmt: skip
        far_load = LoadJob(4, "far", (GroupTransfer(0, (12,), (beyond,), (0,)),), gen,
                           versions=((pin.versions[0],),))  # fmt: skip
        w.start_load_kv(ConnectorMeta(loads=(load, far_load), engine=ENGINE))
        recving: set[str] = set()
        failed: set[str] = set()

        def finished() -> bool:
            got, bad, _ = w.transfer_results()
            recving.update(got)
            failed.update(bad)
            return "near" in recving and "far" in recving

        wait_until(finished)
        assert failed == {"far"}  # the far slot was never copied
        assert all(s < end for s in engine.slots) and beyond not in engine.slots
        for i, b in enumerate((8, 9, 10, 11)):
            assert np.array_equal(expected_block(setup, w.layout, 0, b), want[i])
        w.client.release([pin.pin_id])
        sched.close()
        # the rest of the pre-fault: the rank registers all of it, each piece behind it
        gated_pool.gate.close()
        assert view.wait_ready(20) and w.ready
        assert w.report().ready == {0: True}
        for (ptr, nbytes), at in zip(reg.calls, reg.seen, strict=True):
            assert (ptr - view.base_ptr + nbytes) // slot_bytes <= at
    finally:
        w.shutdown()
