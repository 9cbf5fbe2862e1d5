"""bench/cpu_canary.py: a real canary process's windows, and folding them into sweep rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from cpu_canary import main, summarize  # noqa: E402


def test_a_canary_process_writes_windows_that_a_busy_machine_shows(tmp_path: Path) -> None:
    out = tmp_path / "canary.jsonl"
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # one core taken
    try:
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "bench" / "cpu_canary.py"),
                "--out",
                str(out),
                "--for",
                "1.2",
                "--window",
                "0.4",
                "--tick",
                "0.01",
            ],
            check=True,
            timeout=30,
        )
    finally:
        busy.kill()
        busy.wait()
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 3
    for x in lines:
        assert x["work_p50_us"] > 0 and x["late_p50_us"] >= 0
        assert x["user_pct"] > 10  # the busy loop's core shows as user time
        shares = sum(x[f"{k}_pct"] for k in ("user", "system", "irq", "steal", "idle"))
        assert 99 <= shares <= 101
        assert x["ctxt_per_s"] > 0


def test_summarize_takes_the_windows_inside_each_rows_span() -> None:
    lines = [
        {
            "t": t,
            "work_p50_us": w,
            "late_p50_us": 50,
            "late_p90_us": 90,
            "steal_pct": s,
            "irq_pct": 0.1,
            "ctxt_per_s": 1000,
        }
        for t, w, s in [(10, 500, 0.0), (12, 700, 1.0), (14, 900, 2.0), (30, 5000, 9.0)]
    ]
    rows = [
        {"config": "a", "point": "random@2", "wall_span": [9, 15]},
        {"config": "b", "point": "random@2", "wall_span": [16, 20]},
        {"config": "c", "point": "random@2"},  # a sweep before wall_span: skipped
    ]
    got = summarize(lines, rows)
    assert [g["config"] for g in got] == ["a", "b"]
    assert got[0]["windows"] == 3 and got[0]["work_p50_us"] == 700 and got[0]["steal_pct"] == 1.0
    assert got[1]["windows"] == 0 and got[1]["work_p50_us"] is None


def test_bad_flags_are_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--window", "0", "--out", "x"])
    assert "--window must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([])  # neither --out nor --summarize
    assert "--out: give the JSON lines file" in capsys.readouterr().err
