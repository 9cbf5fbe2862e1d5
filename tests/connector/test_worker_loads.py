"""OffloadWorker: how a load that cannot run reaches vLLM, per load mode.

An async load's request is waiting (WAITING_FOR_REMOTE_KVS): its failure goes out as a finished
and failed receive, and vLLM recomputes the request. A layered load's request runs in this very
step: its failure goes out as invalid block ids, and vLLM recomputes from the first bad block.
The worker here has no pool mapped (no sidecar at the socket), so every load fails fast.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kvoffload_connector.common.config import parse_extra_config
from kvoffload_connector.common.metadata import ConnectorMeta, GroupTransfer, LoadJob, StoreJob
from kvoffload_connector.worker.offload_worker import OffloadWorker


@pytest.fixture
def worker(tmp_path):
    cfg = parse_extra_config({"socket": str(tmp_path / "absent.sock")}, block_size=16)
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, pipeline_parallel_size=1, world_size=1
        ),
        cache_config=SimpleNamespace(block_size=16),
    )
    w = OffloadWorker(cfg, vllm_config=vllm_config, kv_cache_config=None, rank=0)
    yield w
    w.shutdown()


def _load(layered: bool) -> ConnectorMeta:
    transfer = GroupTransfer(0, (5, 6, 9), (3, 3, 4), (2, 3, 0))
    versions = ((20, 20, 21),)  # slots 3, 3, 4 as pinned
    return ConnectorMeta(loads=(LoadJob(7, "req", (transfer,), "gen-1", layered, versions),))


class _Versions:
    """Stands in for the slot table's view: every slot holds the version it was pinned at."""

    def matches(self, slots, versions):
        return True

    def close(self):
        pass


def _arm(worker, tmp_path, engine: int = 5) -> int:
    """A registration with an engine lock range over a real file, and slot versions: what
    store and load jobs need on this rank (the file takes the rank's lock)."""
    path = tmp_path / "pool-0.shm"
    path.write_bytes(bytes(4096))
    worker.pool.path = str(path)
    worker._applied = SimpleNamespace(engine_lock_base=1 << 62, epoch=0)  # noqa: SLF001
    worker.slot_versions = _Versions()
    return engine


def test_failed_layered_load_reports_its_blocks_not_the_request(worker):
    worker.start_load_kv(_load(layered=True))
    worker.wait_for_layer_load("model.layers.0.self_attn.attn")  # nothing to wait for
    recving, failed, blocks = worker.transfer_results()
    assert (recving, failed, blocks) == (set(), set(), set())
    assert worker.take_failed_layered_blocks() == {5, 6, 9}
    assert worker.take_failed_layered_blocks() == set()  # reported once
    report = worker.report()
    assert report is not None and report.failed == {7: 1} and not report.done


def test_failed_async_load_fails_its_request(worker):
    worker.start_load_kv(_load(layered=False))
    recving, failed, blocks = worker.transfer_results()
    assert recving == {"req"} and failed == {"req"} and blocks == {5, 6, 9}
    assert worker.take_failed_layered_blocks() == set()
    report = worker.report()
    assert report is not None and report.failed == {7: 1}


class _IntactPool:
    """Stands in for a mapped PoolView whose file covers it (`intact`), registered whole."""

    ready = True
    usable_end = 1 << 20  # every slot a job names

    def __init__(self, intact: bool = True):
        self._intact = intact
        self.closed = False
        self.path, self.needed_bytes = "/pool/pool-0.shm", 4096
        self.offset = 0

    def intact(self) -> bool:
        return self._intact and not self.closed

    def file_size(self) -> int:
        return 4096 if self._intact else 0

    def close(self) -> None:
        self.closed = True


class _RecordingEngine:
    """Stands in for the CUDA engine (no GPU here): records which waits the worker asks for."""

    def __init__(self):
        self.calls: list[tuple[str, object]] = []

    def submit_layered(self, job_id, batches):
        self.calls.append(("submit_layered", job_id))

    def start_layered(self):
        self.calls.append(("start_layered", None))

    def wait_layer(self, layer_name):
        self.calls.append(("wait_layer", layer_name))

    def wait_all_layers(self):
        self.calls.append(("wait_all_layers", None))

    def new_step(self):
        self.calls.append(("new_step", None))

    def submit(self, job_id, direction, batches):
        self.calls.append(("submit", job_id))

    def wait(self, job_ids):
        self.calls.append(("wait", tuple(job_ids)))
        return []

    def shutdown(self):
        self.calls.append(("shutdown", None))


@pytest.mark.parametrize("layered", [False, True], ids=["async", "layered"])
def test_a_pool_file_shrunk_under_the_mapping_fails_the_step_untouched(worker, layered, caplog):
    """The file no longer covers the mapping: nothing is submitted (a copy would SIGBUS), the
    loads fail as vLLM expects per mode, stores are dropped, the view is closed, one line says
    why, and the next steps fail fast without saying it again."""
    engine, pool = _RecordingEngine(), _IntactPool(intact=False)
    worker.engine, worker.pool, worker.generation = engine, pool, "gen-1"
    with caplog.at_level("WARNING", logger="kvoffload_connector.worker"):
        worker.start_load_kv(_load(layered=layered))
        store = StoreJob(8, 1, "ns", (GroupTransfer(0, (1,), (2,), (0,)),), "gen-1")
        worker.wait_for_save(ConnectorMeta(stores=(store,)))
        worker.start_load_kv(_load(layered=layered))
    assert ("submit_layered", 7) not in engine.calls and ("submit", 8) not in engine.calls
    assert ("shutdown", None) in engine.calls and pool.closed
    assert worker.pool is None and worker.engine is None and not worker.ready
    said = [r.getMessage() for r in caplog.records if "shrank under the mapping" in r.getMessage()]
    assert said == [
        "kvoffload: the pool file /pool/pool-0.shm shrank under the mapping (0 < 4096 bytes); "
        "serving without the pool until the sidecar rebuilds it"
    ]
    recving, failed, blocks = worker.transfer_results()
    if layered:
        assert (failed, blocks) == (set(), set())
        assert worker.take_failed_layered_blocks() == {5, 6, 9}
    else:
        assert recving == {"req"} and failed == {"req"} and blocks == {5, 6, 9}
    report = worker.report()
    assert report is not None and report.failed == {7: 2, 8: 1} and not report.done
    assert worker.take_stats()["pool_file_lost"] == 1


def _graph_config(
    full: bool, mixed: str = "PIECEWISE", enforce_eager: bool = False, spec_tokens: int = 0
) -> SimpleNamespace:
    mode = SimpleNamespace(
        has_full_cudagraphs=lambda: full, mixed_mode=lambda: SimpleNamespace(name=mixed)
    )
    return SimpleNamespace(
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, pipeline_parallel_size=1, world_size=1
        ),
        cache_config=SimpleNamespace(block_size=16),
        model_config=SimpleNamespace(enforce_eager=enforce_eager),
        compilation_config=SimpleNamespace(cudagraph_mode=mode),
        speculative_config=SimpleNamespace(num_speculative_tokens=spec_tokens)
        if spec_tokens
        else None,
    )


@pytest.mark.parametrize(
    ("config", "longest_query", "whole"),
    [
        (_graph_config(True), 16, False),  # FULL_AND_PIECEWISE, mixed batch: piecewise, hooks run
        (_graph_config(True), 1, True),  # ... a uniform decode batch may replay a full graph
        (_graph_config(True), 0, True),  # ... unknown batch shape: assume it may
        (_graph_config(True, mixed="NONE"), 16, False),  # FULL_DECODE_ONLY, mixed: eager
        (_graph_config(True, mixed="FULL"), 16, True),  # FULL: mixed batches in full graphs too
        (_graph_config(True, spec_tokens=2), 3, True),  # uniform with 2 speculative tokens
        (_graph_config(True, spec_tokens=2), 4, False),
        (_graph_config(False), 1, False),  # PIECEWISE only
        (_graph_config(True, enforce_eager=True), 1, False),
    ],
    ids=[
        "full+piecewise-mixed",
        "full+piecewise-uniform",
        "full+piecewise-unknown",
        "full-decode-only-mixed",
        "full-mixed",
        "spec-uniform",
        "spec-mixed",
        "piecewise",
        "eager",
    ],
)
def test_layered_waits_follow_the_cuda_graph_mode(tmp_path, config, longest_query, whole):
    """A full CUDA graph skips wait_for_layer_load, so where this step's forward may replay one
    the whole load is waited for once before the forward; otherwise each layer waits for its
    own bytes (and its attention overlaps the next layers' copies)."""
    cfg = parse_extra_config({"socket": str(tmp_path / "absent.sock")}, block_size=16)
    w = OffloadWorker(cfg, vllm_config=config, kv_cache_config=None, rank=0)
    try:
        engine = _RecordingEngine()
        w.engine, w.pool, w.generation = engine, _IntactPool(), "gen-1"
        w.slot_versions = _Versions()
        meta = _load(layered=True)
        w.start_load_kv(ConnectorMeta(loads=meta.loads, longest_query=longest_query))
        for i in range(2):
            w.wait_for_layer_load(f"model.layers.{i}.self_attn.attn")
        per_layer = [
            ("wait_layer", "model.layers.0.self_attn.attn"),
            ("wait_layer", "model.layers.1.self_attn.attn"),
        ]
        expected = [("wait_all_layers", None)] if whole else per_layer
        assert engine.calls == [("submit_layered", 7), ("start_layered", None), *expected]
        engine.calls.clear()
        w.start_load_kv(ConnectorMeta())  # the next step loads nothing: nothing to wait for
        w.wait_for_layer_load("model.layers.0.self_attn.attn")
        assert engine.calls == [("new_step", None)]
    finally:
        w.engine = w.pool = None
        w.shutdown()


def test_a_fence_finishes_its_jobs_before_the_steps_loads_are_submitted(worker, tmp_path):
    """vLLM got a store's blocks back early (a prefix-cache reset): the next step's metadata
    fences the job, and the worker completes it before anything of that step can write into
    those blocks (this step's loads, then its forward). Ids it never had are skipped."""
    from kvoffload_connector.worker.transfer import JobResult

    engine = _RecordingEngine()
    engine.wait = lambda ids: (
        engine.calls.append(("wait", tuple(ids))) or [JobResult(8, True, 4096, 0.001)]
    )
    worker.engine, worker.pool, worker.generation = engine, _IntactPool(), "gen-1"
    key = _arm(worker, tmp_path)
    store = StoreJob(8, 1, "ns", (GroupTransfer(0, (1,), (2,), (0,)),), "gen-1", 9, key)
    worker.wait_for_save(ConnectorMeta(stores=(store,), engine=key))
    meta = _load(layered=False)
    worker.start_load_kv(ConnectorMeta(loads=meta.loads, fence=(8, 99), engine=key))
    assert engine.calls == [("submit", 8), ("wait", (8,)), ("submit", 7)]
    report = worker.report()
    assert report is not None and report.done == {8: 1}  # the store completed (and commits)
    worker.start_load_kv(ConnectorMeta(fence=(8,)))  # already finished: no second wait
    assert engine.calls.count(("wait", (8,))) == 1


class _CopyingEngine(_RecordingEngine):
    """Completes every load when waited for or polled; `during` runs as if mid-copy."""

    def __init__(self, during=lambda: None):
        super().__init__()
        self.during = during
        self.pending: list[int] = []

    def submit_layered(self, job_id, batches):
        super().submit_layered(job_id, batches)
        self.pending.append(job_id)

    def submit(self, job_id, direction, batches):
        super().submit(job_id, direction, batches)
        self.pending.append(job_id)

    def _finish(self):
        from kvoffload_connector.worker.transfer import JobResult

        self.during()
        done, self.pending = self.pending, []
        return [JobResult(j, True, 4096, 0.001) for j in done]

    def wait(self, job_ids):
        self.calls.append(("wait", tuple(job_ids)))
        return self._finish()

    def poll(self):
        return self._finish()


def _slot_table(tmp_path, states: dict[int, int]):
    """A pool file whose slot table (8 records of 32 bytes at one page) holds `states`."""
    import mmap as _mmap

    import numpy as np
    from kvoffload_connector.worker.slot_versions import SlotVersions

    path = tmp_path / "table.shm"
    path.write_bytes(bytes(2 * _mmap.PAGESIZE))
    table = np.memmap(path, np.uint64, "r+", _mmap.PAGESIZE, (8, 4))
    for slot, state in states.items():
        table[slot, 0] = state
    return table, SlotVersions(str(path), _mmap.PAGESIZE, 32, 8)


@pytest.mark.parametrize("layered", [False, True], ids=["async", "layered"])
def test_a_load_whose_slot_a_store_took_during_the_copy_fails(worker, tmp_path, layered):
    """The pinned slot 4 is re-reserved (a store will write it) while the copy runs: the
    worker reads the slot table after the copy completed, finds another state word, and
    fails the load as vLLM expects for its mode; the same load with the words unchanged
    loads."""
    table, view = _slot_table(tmp_path, {3: 20, 4: 21})
    engine = _CopyingEngine(during=lambda: table.__setitem__((4, 0), 1))  # RESERVED
    worker.engine, worker.pool, worker.generation = engine, _IntactPool(), "gen-1"
    worker.slot_versions = view
    worker.start_load_kv(_load(layered=layered))
    recving, failed, blocks = worker.transfer_results()
    if layered:
        assert ("wait", (7,)) in engine.calls  # synced on the copy before reporting
        assert worker.take_failed_layered_blocks() == {5, 6, 9}
    else:
        assert failed == {"req"} and blocks == {5, 6, 9}
    assert worker.report().failed == {7: 1}
    table[4, 0] = 21  # (not realistic, a version never comes back: the control case)
    engine.during = lambda: None
    worker.start_load_kv(_load(layered=layered))
    recving, failed, blocks = worker.transfer_results()
    assert (failed, blocks) == (set(), set()) and not worker.take_failed_layered_blocks()
    assert worker.report().done == {7: 1}


def test_a_load_without_versions_never_runs(worker, tmp_path):
    _, view = _slot_table(tmp_path, {3: 20, 4: 21})
    engine = _CopyingEngine()
    worker.engine, worker.pool, worker.generation = engine, _IntactPool(), "gen-1"
    worker.slot_versions = view
    transfer = GroupTransfer(0, (5, 6, 9), (3, 3, 4), (2, 3, 0))
    worker.start_load_kv(ConnectorMeta(loads=(LoadJob(7, "req", (transfer,), "gen-1", True),)))
    assert ("submit_layered", 7) not in engine.calls
    assert worker.take_failed_layered_blocks() == {5, 6, 9}


class _Rpc:
    """The worker's RPC thread, queued: what it would send, in order."""

    def __init__(self):
        self.queue = []

    def submit(self, fn):
        self.queue.append(fn)

    def close(self, timeout_s=0.0):
        pass


def test_the_drained_report_waits_for_the_old_instances_copy_and_then_fences_its_jobs(
    worker, tmp_path
):
    """Registered with a new sidecar instance (epoch 2) while a store of the dead one (epoch 1)
    copies: no report until that copy's result came back; then one report naming epoch 2, and
    from then on a store job naming epoch 1 is refused (it never starts its copy)."""
    from kvoffload_connector.worker.transfer import JobResult

    engine = _RecordingEngine()
    worker.engine, worker.pool, worker.generation = engine, _IntactPool(), "gen-1"
    key = _arm(worker, tmp_path)
    worker._applied = SimpleNamespace(engine_lock_base=1 << 62, epoch=1, namespace_id="ns")
    worker._rpc.close()
    worker._rpc = rpc = _Rpc()
    sent = []
    worker.client.report_drained = lambda ns, **kw: sent.append((ns, kw)) or 0
    transfer = (GroupTransfer(0, (1,), (2,), (0,)),)
    old = StoreJob(8, 1, "ns", transfer, "gen-1", 1, key)
    worker.start_load_kv(ConnectorMeta(engine=key))
    worker.wait_for_save(ConnectorMeta(stores=(old,), engine=key))
    assert ("submit", 8) in engine.calls
    rpc.queue.clear()  # the report to epoch 1 itself (its own instance: nothing withheld)
    worker._applied = SimpleNamespace(engine_lock_base=1 << 62, epoch=2, namespace_id="ns")
    worker._report_drained()
    assert rpc.queue == [], "reported with a copy into epoch 1's reservation in flight"
    worker._handle([JobResult(8, True, 4096, 0.001)])  # the copy finished
    assert len(rpc.queue) == 2  # its commit (refused by epoch 2), then the report
    rpc.queue.pop()()
    assert sent == [("ns", {"epoch": 2, "engine": key, "rank": 0})], sent
    late = StoreJob(9, 3, "ns", transfer, "gen-1", 1, key)
    worker.wait_for_save(ConnectorMeta(stores=(late,), engine=key))
    assert ("submit", 9) not in engine.calls and worker.report().failed == {9: 1}
    worker.engine = None
