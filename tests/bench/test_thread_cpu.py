"""bench/thread_cpu.py against real processes: a matched parent's busy child thread is found."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.process
@pytest.mark.timeout(30)
def test_a_busy_descendant_of_a_matched_process_tops_the_list() -> None:
    busy = subprocess.Popen(
        ["sh", "-c", "echo kvo-thread-cpu-marker >/dev/null; yes >/dev/null"],
        start_new_session=True,
    )
    try:
        out = subprocess.run(
            [
                sys.executable,
                str(ROOT / "bench/thread_cpu.py"),
                "--match",
                "kvo-thread-cpu-marker",
                "--window",
                "1",
                "--for",
                "2.5",
                "--top",
                "3",
            ],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    finally:
        os.killpg(busy.pid, signal.SIGKILL)  # the shell and its `yes`
        busy.wait()
    windows = [w for w in out.split("-- ") if w.strip()]
    assert windows, out
    top = windows[-1].splitlines()[1]  # the busiest thread of the last window
    share = float(top.split("%")[0])
    assert "yes" in top and share > 50, out


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--window", "1"], "--match"),
        (["--match", "x", "--window", "0"], "--window must be > 0"),
        (["--match", "x", "--window", "5", "--for", "2"], "--for at least one window"),
    ],
)
def test_bad_flags_are_refused_by_name(args: list[str], says: str) -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench/thread_cpu.py"), *args],
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    assert run.returncode == 2 and says in run.stderr
