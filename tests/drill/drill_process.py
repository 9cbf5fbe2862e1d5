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


def run_drill(script: Path, args: list[str], out: Path, timeout_s: float) -> dict:
    """`script args` (which writes `out`); a run past `timeout_s` or without a report fails the
    test with the log. SIGTERM first: a drill stops its sidecar and engines on it."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, str(script), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            log, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
        pytest.fail(f"{script.name} did not finish in {timeout_s:g} s:\n{log[-6000:]}")
    if not out.exists():
        pytest.fail(f"no report ({proc.returncode}):\n{log[-8000:]}")
    report = json.loads(out.read_text())
    report["returncode"] = proc.returncode
    report["log_tail"] = log[-4000:]
    return report
