"""OffloadWorker: how a load that cannot run reaches vLLM, per load mode.

An async load's request is waiting (WAITING_FOR_REMOTE_KVS): its failure goes out as a finished
and failed receive, and vLLM recomputes the request. A layered load's request runs in this very
step: its failure goes out as invalid block ids, and vLLM recomputes from the first bad block.
The worker here has no pool mapped (no sidecar at the socket), so every load fails fast.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kvoffload_connector.config import parse_extra_config
from kvoffload_connector.metadata import ConnectorMeta, GroupTransfer, LoadJob
from kvoffload_connector.worker import OffloadWorker


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
    return ConnectorMeta(loads=(LoadJob(7, "req", (transfer,), "gen-1", layered),))


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


class _RecordingEngine:
    """Stands in for the CUDA engine (no GPU here): records which waits the worker asks for."""

    def __init__(self):
        self.calls: list[tuple[str, object]] = []

    def submit_layered(self, job_id, batches):
        self.calls.append(("submit_layered", job_id))

    def wait_layer(self, layer_name):
        self.calls.append(("wait_layer", layer_name))

    def wait_all_layers(self):
        self.calls.append(("wait_all_layers", None))

    def new_step(self):
        self.calls.append(("new_step", None))


def _graph_config(full: bool, enforce_eager: bool = False) -> SimpleNamespace:
    mode = SimpleNamespace(has_full_cudagraphs=lambda: full)
    return SimpleNamespace(
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, pipeline_parallel_size=1, world_size=1
        ),
        cache_config=SimpleNamespace(block_size=16),
        model_config=SimpleNamespace(enforce_eager=enforce_eager),
        compilation_config=SimpleNamespace(cudagraph_mode=mode),
    )


@pytest.mark.parametrize(
    ("full", "enforce_eager", "whole"),
    [(True, False, True), (False, False, False), (True, True, False)],
    ids=["full-graphs", "piecewise", "eager"],
)
def test_layered_waits_follow_the_cuda_graph_mode(tmp_path, full, enforce_eager, whole):
    """A full CUDA graph skips wait_for_layer_load, so there the whole load is waited for once
    before the forward; otherwise each layer waits for its own bytes."""
    cfg = parse_extra_config({"socket": str(tmp_path / "absent.sock")}, block_size=16)
    w = OffloadWorker(
        cfg, vllm_config=_graph_config(full, enforce_eager), kv_cache_config=None, rank=0
    )
    try:
        engine = _RecordingEngine()
        w.engine, w.pool, w.generation = engine, SimpleNamespace(ready=True), "gen-1"
        w.start_load_kv(_load(layered=True))
        for i in range(2):
            w.wait_for_layer_load(f"model.layers.{i}.self_attn.attn")
        per_layer = [
            ("wait_layer", "model.layers.0.self_attn.attn"),
            ("wait_layer", "model.layers.1.self_attn.attn"),
        ]
        expected = [("wait_all_layers", None)] if whole else per_layer
        assert engine.calls == [("submit_layered", 7), *expected]
        engine.calls.clear()
        w.start_load_kv(ConnectorMeta())  # the next step loads nothing: nothing to wait for
        w.wait_for_layer_load("model.layers.0.self_attn.attn")
        assert engine.calls == [("new_step", None)]
    finally:
        w.engine = w.pool = None
        w.shutdown()
