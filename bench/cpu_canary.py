"""A CPU canary beside a serving run: is the machine itself slow at times, or one process?

Every TICK seconds it times a fixed pure-Python workload and how late a 2 ms sleep wakes, and
every WINDOW seconds it appends one JSON line: the wall time, those timings' p50/p90 (µs) and
the machine's CPU shares from /proc/stat (user, system, irq+softirq, steal, idle) with context
switches and interrupts per second. `summarize` folds the lines into the sweep rows'
`wall_span`s, so each configuration's point gets the canary's view of the same seconds.

    python bench/cpu_canary.py --out canary.jsonl --for 600 &
    python bench/cpu_canary.py --summarize canary.jsonl sweep.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

WORK_LOOPS = 20_000  # ~0.5-1 ms of interpreter work on the hosts here


def _work() -> float:
    t0 = time.perf_counter()
    acc = 0
    for i in range(WORK_LOOPS):
        acc += i * i
    return time.perf_counter() - t0


def _sleep_late(seconds: float = 0.002) -> float:
    t0 = time.perf_counter()
    time.sleep(seconds)
    return time.perf_counter() - t0 - seconds


def proc_stat() -> dict[str, float]:
    """Machine-wide CPU jiffies by kind, and the ctxt/intr counters, from /proc/stat."""
    out: dict[str, float] = {}
    for line in Path("/proc/stat").read_text().splitlines():
        f = line.split()
        if f[0] == "cpu":
            user, nice, system, idle, iowait, irq, softirq, steal = map(int, f[1:9])
            out.update(
                user=user + nice, system=system, idle=idle + iowait, irq=irq + softirq, steal=steal
            )
        elif f[0] in ("ctxt", "intr"):
            out[f[0]] = int(f[1])
    return out


def window_line(
    works: list[float], lates: list[float], before: dict, after: dict, dt: float
) -> dict:
    """One window's JSON line (timings in µs, CPU kinds as % of all CPU time)."""

    def pct(xs: list[float], q: int) -> float:
        return (
            round(statistics.quantiles(xs, n=10)[q - 1] * 1e6, 1) if len(xs) > 1 else float("nan")
        )

    kinds = ("user", "system", "irq", "steal", "idle")
    total = sum(after[k] - before[k] for k in kinds) or 1
    line = {
        "t": round(time.time(), 3),
        "work_p50_us": round(statistics.median(works) * 1e6, 1),
        "work_p90_us": pct(works, 9),
        "late_p50_us": round(statistics.median(lates) * 1e6, 1),
        "late_p90_us": pct(lates, 9),
    }
    line.update({f"{k}_pct": round(100 * (after[k] - before[k]) / total, 2) for k in kinds})
    line.update({f"{k}_per_s": round((after[k] - before[k]) / dt) for k in ("ctxt", "intr")})
    return line


def run(out: Path, total_s: float, window_s: float, tick_s: float) -> None:
    t_end = time.monotonic() + total_s
    while time.monotonic() < t_end:
        works: list[float] = []
        lates: list[float] = []
        before, w0 = proc_stat(), time.monotonic()
        while time.monotonic() - w0 < window_s:
            works.append(_work())
            lates.append(_sleep_late())
            time.sleep(tick_s)
        line = window_line(works, lates, before, proc_stat(), time.monotonic() - w0)
        with out.open("a") as f:
            f.write(json.dumps(line) + "\n")


def summarize(lines: list[dict], rows: list[dict]) -> list[dict]:
    """Per sweep row with a wall_span: the medians of the canary windows inside it."""
    out = []
    for row in rows:
        span = row.get("wall_span")
        if not span:
            continue
        inside = [x for x in lines if span[0] <= x["t"] <= span[1]]
        summary = {"config": row["config"], "point": row["point"], "windows": len(inside)}
        for key in (
            "work_p50_us",
            "late_p50_us",
            "late_p90_us",
            "steal_pct",
            "irq_pct",
            "ctxt_per_s",
        ):
            vals = [x[key] for x in inside if x[key] == x[key]]
            summary[key] = round(statistics.median(vals), 2) if vals else None
        out.append(summary)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="JSON lines file to append windows to")
    ap.add_argument("--for", dest="total", type=float, default=600.0)
    ap.add_argument("--window", type=float, default=2.0)
    ap.add_argument("--tick", type=float, default=0.02)
    ap.add_argument("--summarize", nargs=2, metavar=("CANARY_JSONL", "SWEEP_JSON"))
    a = ap.parse_args(argv)
    if a.summarize:
        canary, sweep = a.summarize
        lines = [json.loads(x) for x in Path(canary).read_text().splitlines() if x.strip()]
        for s in summarize(lines, json.loads(Path(sweep).read_text())["rows"]):
            print(json.dumps(s))
        return 0
    if a.out is None:
        ap.error("--out: give the JSON lines file (or --summarize)")
    if a.window <= 0 or a.tick < 0 or a.total < a.window:
        ap.error(
            "--window must be > 0, --tick >= 0 and --for at least one window, got "
            f"{a.window}, {a.tick}, {a.total}"
        )
    run(a.out, a.total, a.window, a.tick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
