"""Find vCPUs that share a physical core although the guest is told they do not (a diagnostic).

A VM may report one thread per core while the host runs two of its vCPUs on one hyperthreaded
core: then a busy vCPU slows its hidden sibling by tens of percent, which is one explanation of
the GPU VM's two prefill speeds (session 29: ~45% slower host launches on some requests, on
whichever vCPU). For every pair of vCPUs this times a Python loop pinned to one while another
process spins on the other, against the loop alone; a pair whose loop slows by more than
`--threshold` is reported as siblings, in cpu_sampler's `{"0": [8], ...}` form
(`serve_paired.py --pin-cpus --cpu-siblings FILE` groups servers by them).

    python bench/sibling_probe.py [--out siblings.json] [--window-s 0.15]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path


def _spin(cpu: int, stop: mp.synchronize.Event) -> None:
    os.sched_setaffinity(0, {cpu})
    while not stop.is_set():
        for _ in range(10_000):
            pass


def loop_rate(cpu: int, window_s: float) -> float:
    """Loop iterations per second of this process pinned to `cpu`."""
    os.sched_setaffinity(0, {cpu})
    n, t0 = 0, time.perf_counter()
    while (t := time.perf_counter()) - t0 < window_s:
        for _ in range(10_000):
            pass
        n += 10_000
    return n / (t - t0)


def slowdown(cpu: int, other: int, window_s: float) -> float:
    """How much slower the loop on `cpu` runs while `other` spins (0.3 = 30% slower): the
    better of two tries each way, so a passing interruption does not count."""
    alone = max(loop_rate(cpu, window_s) for _ in range(2))
    stop = mp.Event()
    spinner = mp.Process(target=_spin, args=(other, stop), daemon=True)
    spinner.start()
    try:
        time.sleep(0.02)
        beside = max(loop_rate(cpu, window_s) for _ in range(2))
    finally:
        stop.set()
        spinner.join(5)
    return 1 - beside / alone


def probe(cpus: list[int], window_s: float, threshold: float) -> tuple[dict, dict]:
    """(siblings per vCPU, every pair's slowdown)."""
    slow: dict[str, float] = {}
    siblings: dict[str, list[int]] = {str(c): [] for c in cpus}
    for i, a in enumerate(cpus):
        for b in cpus[i + 1 :]:
            s = slowdown(a, b, window_s)
            slow[f"{a}-{b}"] = round(s, 3)
            if s > threshold:
                siblings[str(a)].append(b)
                siblings[str(b)].append(a)
    return siblings, slow


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--window-s", type=float, default=0.15)
    p.add_argument("--threshold", type=float, default=0.15, help="slowdown that means siblings")
    a = p.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    try:
        siblings, slow = probe(cpus, a.window_s, a.threshold)
    finally:
        os.sched_setaffinity(0, cpus)
    worst = sorted(slow.items(), key=lambda kv: -kv[1])[:12]
    print("most slowed pairs:", ", ".join(f"{k} {v:+.0%}" for k, v in worst))
    print("siblings:", json.dumps(siblings))
    if a.out:
        a.out.write_text(json.dumps({"siblings": siblings, "slowdown": slow}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
