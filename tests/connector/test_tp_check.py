"""Tensor parallel: a pool hit gives the GPU hit's tokens on every rank (tp_check.py beside this).

On two GPUs the `gpu` test runs the whole check (vLLM 0.26, Llama-3-8B shape, TP=2). Everywhere,
tp_check's verdicts are fed an H200 x2 run's own record (data/tp_check_h200x2.json).

That run (vLLM 0.26, TP=2, eager) passed every substantive check but said NO: it required the
connector's hit tokens from Prometheus, which vLLM 0.26's offline engine never updates for a
pool hit (the counting step has no request output, see tp_check.ConnectorTap). The verdicts now
rest on the sidecar's hit/loaded deltas and take a connector counter only where it is reported;
the same record must read all "yes", and the same record altered where a real failure would
show must read NO.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "tp_check.py"
GPU_RUN = Path(__file__).resolve().parent / "data" / "tp_check_h200x2.json"
MODEL = ROOT / "bench" / "e2e_models" / "llama3-8b"


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("tp_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["tp_check"] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


tp = _load()


@pytest.fixture
def run() -> dict[str, Any]:
    return json.loads(GPU_RUN.read_text())


def test_the_gpu_run_reads_all_yes(run: dict[str, Any]) -> None:
    assert run["ok"] is False  # as recorded then: the old verdict
    rows, ranks, ok = tp.summarize(run)
    assert [r["phase"] for r in rows] == [
        "cold",
        "gpu_hit",
        "pool_hit",
        "corrupt_r0",
        "corrupt_r1",
        "restored",
    ]
    assert [r["ok"] for r in rows] == ["yes"] * 6, [r["why"] for r in rows]
    assert [r["ok"] for r in ranks] == ["yes", "yes"]
    assert ok is True
    by = {r["phase"]: r for r in rows}
    # 4 prompts x 62 chunks of 64 tokens from the pool, both ranks' bytes loaded
    assert tp.Plan.of(run) == tp.Plan(prompts=4, chunks=62, chunk=64, tp=2)
    assert by["pool_hit"]["sidecar hit/loaded chunks"] == "248/248"
    assert by["pool_hit"]["ranks' worth loaded"] == 2.0
    # Prometheus saw no scheduler-side counter while the sidecar saw lookups: not reported
    assert by["pool_hit"]["connector hit tokens"] == "n/a"
    assert by["gpu_hit"]["connector hit tokens"] == 0  # no lookup at all: a real zero


def _fails(run: dict[str, Any], why: str) -> None:
    rows, ranks, ok = tp.summarize(run)
    assert ok is False
    said = [r.get("why", "") for r in rows] + [str(r) for r in ranks if r["ok"] == "NO"]
    assert any(why in w for w in said), said


def test_a_partial_pool_hit_is_a_no(run: dict[str, Any]) -> None:
    run["phases"]["pool_hit"]["pool"]["loaded_blocks"] = 247
    _fails(run, "sidecar hit/loaded 248/247, want 248")


def test_one_rank_worth_of_bytes_is_a_no(run: dict[str, Any]) -> None:
    run["phases"]["restored"]["loaded_bytes"] /= 2
    _fails(run, "want 2 x 1040187392")


def test_a_rank_whose_corruption_changed_nothing_is_a_no(run: dict[str, Any]) -> None:
    c = run["phases"]["corrupt_r1"]["compare"]
    c.update(tokens_equal=True, logprobs_equal=True, differing_prompts=0)
    _fails(run, "outputs unchanged")
    _, ranks, _ = tp.summarize(run)
    assert [r["ok"] for r in ranks] == ["yes", "NO"]


def test_outputs_not_given_back_after_restoring_fail_every_rank(run: dict[str, Any]) -> None:
    run["phases"]["restored"]["compare"].update(tokens_equal=False, differing_prompts=1)
    _fails(run, "1 prompts' tokens differ")
    _, ranks, _ = tp.summarize(run)
    assert [r["ok"] for r in ranks] == ["NO", "NO"]


def test_a_reported_connector_hit_must_match(run: dict[str, Any]) -> None:
    """Where the tap reports (every step seen), a zero hit is a NO, not "n/a"."""
    good = copy.deepcopy(run)
    for r in (run, good):
        for name, p in r["phases"].items():
            chunks = tp.expect(name, tp.Plan.of(r))[1]
            raw = {
                "hit_tokens": chunks * 64.0,
                "queried_tokens": 4 * 3969.0,
                "lookups": 4.0,
                "loaded_bytes": p["loaded_bytes"],
                "failed_loads": 0.0,
            }
            p["connector"] = tp.reported(raw, tp.TAP, p["pool"])
    assert tp.summarize(good)[2] is True
    assert tp.summarize(good)[0][2]["connector hit tokens"] == 248 * 64
    run["phases"]["pool_hit"]["connector"]["hit_tokens"] = 0.0
    _fails(run, "connector hit 0 tokens, want 15872")


def test_a_missing_phase_or_a_reference_mismatch_is_a_no(run: dict[str, Any]) -> None:
    del run["phases"]["corrupt_r1"]
    assert tp.summarize(run)[2] is False
    run = json.loads(GPU_RUN.read_text())
    run["reference"] = {"tokens_equal": False, "logprobs_equal": False, "differing_prompts": 3}
    _fails(run, "3 prompts differ")
    run["reference"] = {"timed_out": True}  # not run in time: said, not a verdict
    assert tp.summarize(run)[2] is True


def test_reported_prometheus_rules() -> None:
    pool_hit = {"lookups": 4, "hit_blocks": 248, "loaded_blocks": 248}
    got = tp.reported({"loaded_bytes": 8.0}, tp.PROMETHEUS, pool_hit)
    assert got["hit_tokens"] is None and got["lookups"] is None and got["loaded_bytes"] == 8.0
    got = tp.reported({"queried_tokens": 9.0, "hit_tokens": 0.0}, tp.PROMETHEUS, pool_hit)
    assert got["hit_tokens"] == 0.0 and got["loaded_bytes"] is None
    assert tp.reported({}, tp.TAP, pool_hit)["hit_tokens"] == 0.0


def test_the_tap_sums_every_step_and_passes_the_stats_on() -> None:
    """make_stats wrapped on the scheduler instance: vLLM gets its stats object unchanged."""
    steps = iter([{"hit_tokens": 128, "lookups": 1}, None, {"hit_tokens": 64, "loaded_bytes": 9}])

    class Scheduler:
        def make_stats(self, *a: Any, **kw: Any) -> Any:
            return SimpleNamespace(kv_connector_stats=next(steps), args=(a, kw))

    sched = Scheduler()
    core = SimpleNamespace(engine_core=SimpleNamespace(scheduler=sched))
    tap = tp.ConnectorTap(SimpleNamespace(llm_engine=SimpleNamespace(engine_core=core)))
    assert tap.source == tp.TAP
    assert sched.make_stats(None, kv_connector_stats=1).args == ((None,), {"kv_connector_stats": 1})
    sched.make_stats()
    sched.make_stats()
    assert tap.read() == {"hit_tokens": 192.0, "lookups": 1.0, "loaded_bytes": 9.0}
    out_of_process = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=object()))
    assert tp.ConnectorTap(out_of_process).source == tp.PROMETHEUS


def _gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs two CUDA GPUs")
def test_tp2_pool_hit_gives_the_gpu_hits_tokens_on_every_rank(tmp_path: Path) -> None:
    """The whole check at TP=2 (~140 s on two H200s): every phase and every rank says yes."""
    out = tmp_path / "tp_check.json"
    env = dict(os.environ, PYTHONHASHSEED="0", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    cmd = [sys.executable, str(SCRIPT), "--model", str(MODEL), "--tp", "2", "--dtype", "bfloat16"]
    cmd += ["--gpu-memory-utilization", "0.4", "--budget-s", "240", "--out", str(out)]
    cmd += ["--sidecar-log", str(tmp_path / "sidecar.log")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got["ok"] is True
    assert [r["ok"] for r in got["per_rank"]] == ["yes", "yes"]
