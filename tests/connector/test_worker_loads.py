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
