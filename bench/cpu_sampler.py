"""Per-vCPU time shares every 200 ms, for joining with a benchmark's requests (a diagnostic).

`serve_gpu_run.sh` runs it beside the servers. Each line is one JSON object:
`{"t": EPOCH_S, "cpus": {"0": [busy, irq, steal], ...}}`, the percentage of that vCPU's time
since the previous line. The first line, `{"siblings": {"0": [8], ...}}`, names each vCPU's
hyperthread siblings as the guest sees them (a busy sibling slows a core's other thread).
busy counts everything but idle and iowait; irq is hard plus soft interrupts; steal is time the
hypervisor ran something else.

Why: on the GPU VM a request's prefill runs ~45% slower in some periods, on whichever vCPU
the engine thread sits (session 29), and the guest's clock rate and total steal stay flat.
Interrupts and steal on the engine's own vCPU are the next things to look at.

    python bench/cpu_sampler.py OUT.jsonl [--period-s 0.2]
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
import time
from pathlib import Path

# /proc/stat columns after the name: user nice system idle iowait irq softirq steal ...
_IDLE, _IOWAIT, _IRQ, _SOFTIRQ, _STEAL = 3, 4, 5, 6, 7


def read_ticks(text: str) -> dict[str, list[int]]:
    """Each vCPU's tick counters from /proc/stat's text (the all-CPU line left out)."""
    out = {}
    for line in text.splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu":
            out[name[3:]] = [int(x) for x in fields]
    return out


def shares(before: dict[str, list[int]], after: dict[str, list[int]]) -> dict[str, list[float]]:
    """Per vCPU in both: [busy, irq, steal] as % of its ticks between the two readings."""
    out = {}
    for cpu, now in after.items():
        was = before.get(cpu)
        if was is None:
            continue
        d = [a - b for a, b in zip(now, was, strict=False)]
        total = sum(d)
        if total <= 0:
            continue
        idle = d[_IDLE] + d[_IOWAIT]
        steal = d[_STEAL] if len(d) > _STEAL else 0
        out[cpu] = [
            round(100 * (total - idle) / total, 1),
            round(100 * (d[_IRQ] + d[_SOFTIRQ]) / total, 1),
            round(100 * steal / total, 1),
        ]
    return out


def parse_cpu_list(text: str) -> list[int]:
    """A kernel CPU list ("0,8" or "0-3,8-11") as numbers."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def read_siblings(cpu_root: Path = Path("/sys/devices/system/cpu")) -> dict[str, list[int]]:
    """Each vCPU's hyperthread siblings (itself left out), from sysfs topology."""
    out = {}
    for f in sorted(cpu_root.glob("cpu[0-9]*/topology/thread_siblings_list")):
        cpu = int(f.parts[-3][3:])
        out[str(cpu)] = [c for c in parse_cpu_list(f.read_text()) if c != cpu]
    return out


def sample_forever(out: Path, period_s: float) -> None:
    last = read_ticks(Path("/proc/stat").read_text())
    with out.open("a") as f:
        f.write(json.dumps({"siblings": read_siblings()}) + "\n")
        while True:
            time.sleep(period_s)
            now = read_ticks(Path("/proc/stat").read_text())
            f.write(json.dumps({"t": round(time.time(), 3), "cpus": shares(last, now)}) + "\n")
            f.flush()
            last = now


def read_samples(path: Path) -> list[tuple[float, dict[str, list[float]]]]:
    """The sampler's lines as (epoch, per-vCPU shares), by time; unreadable lines skipped."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            obj = json.loads(line)
            rows.append((float(obj["t"]), dict(obj["cpus"])))
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by the kill
    return sorted(rows, key=lambda r: r[0])


def siblings_in(path: Path) -> dict[str, list[int]]:
    """The sampler's siblings line ({} where the file has none)."""
    for line in path.read_text().splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and "siblings" in obj:
            return {str(k): [int(c) for c in v] for k, v in obj["siblings"].items()}
    return {}


def share_at(
    samples: list[tuple[float, dict[str, list[float]]]], t: float, cpu: int
) -> list[float] | None:
    """[busy, irq, steal] of `cpu` over the sample window that holds time `t` (the first
    sample taken after it), or None outside the samples."""
    i = bisect.bisect_left([s[0] for s in samples], t)
    if i >= len(samples) or (i == 0 and len(samples) > 1 and t < 2 * samples[0][0] - samples[1][0]):
        return None
    return samples[i][1].get(str(cpu))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--period-s", type=float, default=0.2)
    a = p.parse_args(argv)
    sample_forever(a.out, a.period_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
