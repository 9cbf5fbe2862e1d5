"""bench/thread_cpu.py against real processes: a matched parent's busy child thread is found,
a timer thread's wake-ups and a spinner's CPU are counted over a whole process tree."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))


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


# a child with a thread that wakes on a 5 ms timer and one that spins, under a grandchild
_CHILD = """
import subprocess, sys, threading, time
stop = threading.Event()
def timer():
    while not stop.wait(0.005):
        pass
def spin():
    while not stop.is_set():
        sum(range(1000))
threading.Thread(target=timer, name="timer").start()
threading.Thread(target=spin, name="spin").start()
grandchild = subprocess.Popen(["sleep", "30"])
print(grandchild.pid, flush=True)
time.sleep(30)
"""


@pytest.mark.process
@pytest.mark.timeout(60)
def test_activity_counts_a_timer_threads_wakes_and_a_spinners_cpu_over_the_tree() -> None:
    from thread_cpu import activity, descendants, snapshot

    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        assert set(descendants([child.pid])) >= {child.pid, grandchild}
        # a root below another root is walked once
        assert sorted(descendants([child.pid, grandchild])) == sorted(descendants([child.pid]))
        before = snapshot([child.pid])
        time.sleep(1.0)
        after = snapshot([child.pid])
        report = activity(before, after, 1.0, top=10)
    finally:
        child.kill()
        child.wait()
    by_cpu = sorted(report["top"], key=lambda r: -r["cpu_ms_per_s"])
    spinner = by_cpu[0]
    assert spinner["cpu_ms_per_s"] > 200, report  # a Python spin loop: most of a core
    # the timer thread: ~200 wakes/s (less on a loaded box), little CPU; it tops the wake list
    # with the spinner (which the GIL hands back and forth), above the idle main thread
    timer = [r for r in report["top"] if r["tid"] != spinner["tid"]][0]
    assert timer["wakes_per_s"] > 50 and timer["cpu_ms_per_s"] < spinner["cpu_ms_per_s"], report
    assert report["cpu_ms_per_s"] >= spinner["cpu_ms_per_s"]
    assert any(p.startswith("sleep ") for p in report["processes"])  # the grandchild's tree too


def test_py_spy_dump_lines_map_native_ids_to_python_thread_names() -> None:
    from thread_cpu import parse_py_spy_dump

    text = (
        "Process 24505: VLLM::Worker\n"
        'Thread 24505 (active): "MainThread"\n'
        "    sched_yield (libc.so.6)\n"
        'Thread 24579 (idle): "kvoffload-rank0-rpc"\n'
        'Thread 0x7F5B865C71F5 (idle): "no native id"\n'
    )
    assert parse_py_spy_dump(text) == {24505: "MainThread", 24579: "kvoffload-rank0-rpc"}


def test_activity_refuses_an_empty_window() -> None:
    from thread_cpu import activity

    with pytest.raises(ValueError, match="seconds"):
        activity({}, {}, 0)
