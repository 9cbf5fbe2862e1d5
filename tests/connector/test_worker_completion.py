"""OffloadWorker: a store whose copy finishes while no engine step runs still commits.

vLLM asks the worker for results only inside a step (`get_finished` /
`get_transfer_results`), and an idle engine takes none: the last request's stores would stay
reserved until the next request. The worker's completion thread waits in the transfer engine
and commits them; the step's report still counts each job exactly once (the scheduler fences
the job's GPU blocks until every rank reported it).

Real pieces: `CpuTorchEngine` on its copy thread over a real pool file, the worker's RPC
thread. The sidecar's commit call is recorded instead of sent, and the engine lock a
registration would give is taken as held.
"""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from kvoffload_connector.common.config import parse_extra_config
from kvoffload_connector.common.metadata import ConnectorMeta, GroupTransfer, StoreJob
from kvoffload_connector.worker.layout import canonicalize
from kvoffload_connector.worker.offload_worker import OffloadWorker
from kvoffload_connector.worker.pool_view import PoolView
from kvoffload_connector.worker.transfer import Direction, TransferBatch
from kvoffload_connector.worker.transfer.cpu import CpuTorchEngine

from tests.connector.kv_setup import expected_block, fill_random, make_kv_caches

CHUNK_BLOCKS = 4


class _Commits:
    """The sidecar's CommitStore as the worker calls it, recorded (any thread)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.threads: set[str] = set()
        self._cv = threading.Condition()

    def __call__(self, *args, **kwargs) -> bool:
        with self._cv:
            self.calls.append(args)
            self.threads.add(threading.current_thread().name)
            self._cv.notify_all()
        return True

    def wait_for(self, n: int, timeout_s: float) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: len(self.calls) >= n, timeout_s)


@pytest.fixture
def rig(tmp_path):
    """A worker with a CPU engine over a real pool file, its commits recorded."""
    setup = make_kv_caches("LBHNC", num_blocks=24)
    layout = canonicalize(setup.kv_caches, setup.layer_groups, CHUNK_BLOCKS, setup.kv_cache_config)
    fill_random(layout, seed=3)
    base = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    path = os.path.join(base, f"kvoffload-done-{os.getpid()}-{id(tmp_path)}.shm")
    slots = 8
    with open(path, "wb") as f:
        f.truncate(layout.slot_bytes * slots + 8192)
    pool = PoolView.open(path, 4096, layout.slot_bytes, slots)
    pool.start_device_registration(torch.device("cpu"))
    cfg = parse_extra_config({"socket": str(tmp_path / "absent.sock")}, block_size=4)
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, pipeline_parallel_size=1, world_size=1
        ),
        cache_config=SimpleNamespace(block_size=4),
    )
    w = OffloadWorker(cfg, vllm_config=vllm_config, kv_cache_config=None, rank=0)
    commits = _Commits()
    w.client.commit_store = commits  # type: ignore[method-assign]
    w.layout, w.pool, w.generation = layout, pool, "gen-1"
    w.engine = CpuTorchEngine(layout, pool)
    # the slot protocol's engine lock comes with a sidecar registration (none here): held
    w._hold_engine_lock = lambda engine: True  # type: ignore[method-assign]
    w._start_completion()  # what _apply does once it built the engine
    yield SimpleNamespace(worker=w, commits=commits, setup=setup, layout=layout, path=path)
    w.shutdown()
    os.unlink(path)


def _store(job_id: int, store_id: int, slot: int, blocks: tuple[int, ...]) -> StoreJob:
    transfer = GroupTransfer(0, blocks, (slot,) * len(blocks), tuple(range(len(blocks))))
    return StoreJob(job_id, store_id, "ns-1", (transfer,), "gen-1")


def _slot_bytes_match(rig, slot: int, blocks: tuple[int, ...]) -> bool:
    """The pool slot holds the GPU blocks' bytes (the copy really ran before the commit)."""
    g = rig.layout.groups[0]
    start = 4096 + slot * rig.layout.slot_bytes  # read from the file: the view may be closed
    flat = np.fromfile(rig.path, dtype=np.uint8, count=rig.layout.slot_bytes, offset=start)
    for i, b in enumerate(blocks):
        got = flat[i * g.block_bytes : (i + 1) * g.block_bytes]
        if not np.array_equal(got, expected_block(rig.setup, rig.layout, 0, b)):
            return False
    return True


def test_a_store_finishing_between_steps_commits_once_and_is_reported_once(rig):
    w, commits = rig.worker, rig.commits
    w.wait_for_save(ConnectorMeta(stores=(_store(11, 501, 2, (3, 4, 5, 6)),)))
    # no step runs: nothing calls transfer_results or report
    assert commits.wait_for(1, timeout_s=5.0), "the finished store was never committed"
    assert commits.calls[0][:3] == ("ns-1", 501, 0), commits.calls
    assert _slot_bytes_match(rig, 2, (3, 4, 5, 6))
    assert not any(name.startswith("MainThread") for name in commits.threads)
    # the next step reports it done, once; later steps do not report it again
    assert w.transfer_results() == (set(), set(), set())
    report = w.report()
    assert report is not None and report.done == {11: 1} and not report.failed
    assert w.transfer_results() == (set(), set(), set())
    again = w.report()
    assert again is None or (not again.done and not again.failed)
    w._rpc.drain()
    assert len(commits.calls) == 1, commits.calls
    assert w.take_stats().get("stored_bytes", 0) > 0


def test_stores_racing_the_steps_commit_once_each_and_are_reported_once_each(rig):
    """Stores submitted back to back while the step polls in a tight loop: whichever thread
    sees a finished job first handles it; no commit or report is lost or doubled."""
    w, commits = rig.worker, rig.commits
    jobs = 40
    done: dict[int, int] = {}
    for j in range(jobs):
        slot, first = j % 8, (j * 4) % 20
        w.wait_for_save(ConnectorMeta(stores=(_store(100 + j, 900 + j, slot, (first,)),)))
        if j % 3 == 0:  # some steps poll right away, racing the completion thread
            w.transfer_results()
            r = w.report()
            for k, n in (r.done if r else {}).items():
                done[k] = done.get(k, 0) + n
    assert commits.wait_for(jobs, timeout_s=10.0), f"{len(commits.calls)} of {jobs} committed"
    deadline = time.monotonic() + 5
    while sum(done.values()) < jobs and time.monotonic() < deadline:
        w.transfer_results()
        r = w.report()
        for k, n in (r.done if r else {}).items():
            done[k] = done.get(k, 0) + n
        time.sleep(0.01)
    assert done == {100 + j: 1 for j in range(jobs)}
    w._rpc.drain()
    assert sorted(c[1] for c in commits.calls) == [900 + j for j in range(jobs)]


def test_a_store_still_copying_at_shutdown_commits(rig):
    """Shutdown waits for copies in flight (they end) and their commits go out before the
    RPC thread closes."""
    w, commits = rig.worker, rig.commits
    gate = threading.Event()
    engine = w.engine
    original = engine._copy

    def slow_copy(direction: Direction, b: TransferBatch) -> None:
        gate.wait(5)
        original(direction, b)

    engine._copy = slow_copy  # type: ignore[method-assign]
    w.wait_for_save(ConnectorMeta(stores=(_store(21, 777, 1, (7, 8)),)))
    threading.Timer(0.3, gate.set).start()
    w.shutdown()
    assert [c[1] for c in commits.calls] == [777]
    assert _slot_bytes_match(rig, 1, (7, 8))
