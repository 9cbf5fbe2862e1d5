"""The GPU tier's KV capacity the scheduler's connector writes in its status file (stdlib only:
fakes of the vLLM config fields it reads)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from kvoffload_connector.capacity import gpu_capacity
from kvoffload_connector.guard import write_status


def _vllm_config(num_gpu_blocks=None, block_size=16, served=None, model="/models/llama"):
    return SimpleNamespace(
        model_config=SimpleNamespace(served_model_name=served, model=model),
        cache_config=SimpleNamespace(num_gpu_blocks=num_gpu_blocks, block_size=block_size),
    )


def _kv_cache_config(num_blocks, *block_sizes):
    groups = [SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=b)) for b in block_sizes]
    return SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=groups)


def test_from_the_kv_cache_config_the_scheduler_gets() -> None:
    got = gpu_capacity(_vllm_config(served="llama-8b"), _kv_cache_config(1000, 128))
    assert got == {
        "model": "llama-8b",
        "num_gpu_blocks": 1000,
        "block_size": 128,
        "kv_groups": 1,
        "gpu_kv_tokens": 128_000,
    }


def test_groups_share_the_blocks() -> None:
    """A hybrid model's groups each take blocks from the one pool: tokens per group."""
    got = gpu_capacity(_vllm_config(), _kv_cache_config(1000, 32, 32))
    assert (got["kv_groups"], got["gpu_kv_tokens"], got["model"]) == (2, 16_000, "/models/llama")


def test_without_a_kv_cache_config_the_cache_config_says_it() -> None:
    """vLLM 0.26 passes no kv_cache_config; the engine sized cache_config.num_gpu_blocks."""
    got = gpu_capacity(_vllm_config(num_gpu_blocks=500, block_size=16))
    assert (got["num_gpu_blocks"], got["block_size"], got["gpu_kv_tokens"]) == (500, 16, 8000)


def test_unsized_or_unknown_configs_say_nothing() -> None:
    assert gpu_capacity(_vllm_config(num_gpu_blocks=None)) == {}
    assert gpu_capacity(_vllm_config(num_gpu_blocks=0)) == {}
    assert gpu_capacity(object()) == {}
    assert gpu_capacity(_vllm_config(num_gpu_blocks="many")) == {}


def test_status_file_carries_the_capacity_and_keeps_its_own_fields(tmp_path: Path) -> None:
    sock = str(tmp_path / "pool.sock")
    extra = {**gpu_capacity(_vllm_config(num_gpu_blocks=10)), "state": "overridden?"}
    path = write_status(sock, "active", "", "scheduler", 0, "0.32.0", extra)
    assert path == tmp_path / "connector-status-scheduler-0.json"
    body = json.loads(path.read_text())
    assert body["gpu_kv_tokens"] == 160 and body["num_gpu_blocks"] == 10
    assert (body["state"], body["role"], body["rank"]) == ("active", "scheduler", 0)
