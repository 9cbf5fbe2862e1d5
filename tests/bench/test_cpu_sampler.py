"""bench/cpu_sampler.py: per-vCPU time shares, sampled by a real process, read back by time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from cpu_sampler import (  # noqa: E402
    parse_cpu_list,
    read_samples,
    read_siblings,
    read_ticks,
    share_at,
    shares,
    siblings_in,
)


def test_shares_split_each_vcpus_ticks_into_busy_interrupts_and_steal() -> None:
    before = read_ticks(
        "cpu  9 9 9 9 9 9 9 9 0 0\n"  # the all-CPU line is left out
        "cpu0 100 0 50 800 10 5 5 30 0 0\n"
        "cpu1 10 0 10 100 0 0 0 0 0 0\n"
    )
    after = read_ticks(
        "cpu  9 9 9 9 9 9 9 9 0 0\n"
        "cpu0 140 0 60 830 10 10 10 40 0 0\n"  # 100 ticks: 30 idle, 10 irq, 10 steal
        "cpu1 10 0 10 100 0 0 0 0 0 0\n"  # no ticks (offline): no share
        "cpu2 1 1 1 1 1 1 1 1 0 0\n"  # appeared: no earlier reading
    )
    assert shares(before, after) == {"0": [70.0, 10.0, 10.0]}


def test_a_real_sampler_writes_every_vcpu_and_requests_find_their_window(tmp_path: Path) -> None:
    out = tmp_path / "cpu_state.jsonl"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench/cpu_sampler.py"), str(out), "--period-s", "0.1"]
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (
            not out.exists() or len(out.read_text().splitlines()) < 5  # siblings + 4 samples
        ):
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    with out.open("a") as f:
        f.write('{"t": 1')  # a line cut short by the kill is skipped
    samples = read_samples(out)
    assert len(samples) >= 4
    assert siblings_in(out) == read_siblings()  # the topology line first, not a sample
    times = [t for t, _ in samples]
    assert times == sorted(times) and abs(times[-1] - time.time()) < 60
    ncpu = os.cpu_count() or 1
    for _, cpus in samples:
        assert set(cpus) == {str(i) for i in range(ncpu)}  # every vCPU, each line
        assert all(0 <= x <= 100 for v in cpus.values() for x in v)
    # a request sent inside the second window reads that window; before the first, nothing
    mid = (times[0] + times[1]) / 2
    assert share_at(samples, mid, 0) == samples[1][1]["0"]
    assert share_at(samples, times[0] - 10, 0) is None
    assert share_at(samples, times[-1] + 10, 0) is None
    assert share_at(samples, mid, ncpu + 5) is None  # a vCPU the sampler never saw


def test_siblings_come_from_the_kernels_topology_lists(tmp_path: Path) -> None:
    assert parse_cpu_list("0-3,8-9\n") == [0, 1, 2, 3, 8, 9]
    assert parse_cpu_list("5") == [5]
    for cpu, text in ((0, "0,2"), (1, "1"), (2, "0,2"), (10, "10-11")):
        d = tmp_path / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(text + "\n")
    (tmp_path / "cpufreq").mkdir()  # not a vCPU
    assert read_siblings(tmp_path) == {"0": [2], "1": [], "2": [0], "10": [11]}
    assert siblings_in(tmp_path / "cpu0" / "topology" / "thread_siblings_list") == {}
