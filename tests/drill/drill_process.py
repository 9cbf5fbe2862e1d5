"""Run a drill script (fault_drill.py, chaos_drill.py) as its tests do: a subprocess in its own
session with a timeout; its JSON report, with its exit status and the tail of its log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import vllm_zygote


def run_drill(script: Path, args: list[str], out: Path, timeout_s: float) -> dict:
    """`script args` (which writes `out`); a run past `timeout_s` or without a report fails the
    test with the log. SIGTERM first: a drill stops its sidecar and engines on it. Started
    from a pre-imported vLLM (tests/vllm_zygote.py), the hash seed fixed as the injector does."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("PYTHONHASHSEED", "0")
    log_path = out.with_suffix(".log")
    with open(log_path, "wb") as log_file:
        proc = vllm_zygote.popen(
            [sys.executable, str(script), *args],
            stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log = log_path.read_text(errors="replace")
        pytest.fail(f"{script.name} did not finish in {timeout_s:g} s:\n{log[-6000:]}")
    log = log_path.read_text(errors="replace")
    if not out.exists():
        pytest.fail(f"no report ({proc.returncode}):\n{log[-8000:]}")
    report = json.loads(out.read_text())
    report["returncode"] = proc.returncode
    report["log_tail"] = log[-4000:]
    return report
