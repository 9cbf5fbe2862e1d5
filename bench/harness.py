"""What every benchmark here shares: the machine it ran on, spreads, a printed table, the JSON.

A benchmark measures, then calls `report(name, rows, extra, out)`: the table goes to stdout and
the JSON (machine, date, commit, rows, extra) to `out`. Spreads are `spread(values)`: the
median with min/p99/max, never a lone mean. `rotations(items, rounds)` gives side-by-side
orders for A/B runs (each item first once per cycle), so drift does not favour one side.
"""

from __future__ import annotations

import datetime as _dt
import json
import lzma
import os
import platform
import random
import statistics
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _commit() -> str:
    """HEAD's short hash, with "+dirty" when tracked files differ from it (a number measured
    on uncommitted code says so)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=5, check=False
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        return (
            f"{head}+dirty"
            if head and git("status", "--porcelain", "--untracked-files=no")
            else head
        )
    except (OSError, subprocess.SubprocessError):
        return ""


def read_result(path: Path) -> Any:
    """A results file, plain JSON or `.json.xz` (older results are kept compressed: the tree
    travels to the GPU machine with a 64 MiB limit)."""
    data = path.read_bytes()
    return json.loads(lzma.decompress(data) if path.suffix == ".xz" else data)


def result_stem(path: Path) -> str:
    """`h200_01` for `h200_01.json` and for `h200_01.json.xz`."""
    name = path.name.removesuffix(".xz")
    return name.removesuffix(".json") if name.endswith(".json") else Path(name).stem


def call_names(files: Sequence[Path]) -> dict[str, Path]:
    """One name per results file: its stem, or its folder and stem where stems repeat (each
    device call writes `$OUT/NAME.json`); a file given twice is refused."""
    if len(set(map(Path.resolve, files))) != len(files):
        raise SystemExit("a file is given twice")
    stems = [result_stem(f) for f in files]
    if len(set(stems)) == len(stems):
        return dict(zip(stems, files, strict=True))
    return {f"{f.parent.name}/{s}": f for f, s in zip(files, stems, strict=True)}


def machine() -> dict[str, Any]:
    """Where a number was measured: host, CPUs, GPU when there is one, commit, date (UTC)."""
    info: dict[str, Any] = {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    info["commit"] = _commit()
    try:
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
        if gpu:
            info["gpu"] = gpu.splitlines()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), nearest rank; nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


def spread(values: Iterable[float]) -> dict[str, float]:
    """n, median, min, p99, max of `values` (nan fields when empty)."""
    vals = [float(v) for v in values]
    if not vals:
        nan = float("nan")
        return {"n": 0, "p50": nan, "min": nan, "p99": nan, "max": nan}
    return {
        "n": len(vals),
        "p50": statistics.median(vals),
        "min": min(vals),
        "p99": percentile(vals, 99),
        "max": max(vals),
    }


def bootstrap_median_ci(
    values: Sequence[float],
    resamples: int = 2000,
    seed: int = 0,
    level: float = 0.95,
    q: float = 50.0,
) -> tuple[float, float]:
    """A percentile-bootstrap confidence interval of the median of `values` (or of their q-th
    percentile; paired ratios: is 1.0 inside?). Seeded, so a report is reproducible."""
    if not values:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    n = len(values)
    stat = statistics.median if q == 50.0 else (lambda v: percentile(v, q))
    stats = sorted(stat(rng.choices(values, k=n)) for _ in range(resamples))
    return percentile(stats, 100 * (1 - level) / 2), percentile(stats, 100 * (1 + level) / 2)


def rotations(items: Sequence[Any], rounds: int) -> list[list[Any]]:
    """`rounds` orders of `items`, rotating which goes first (A B C, B C A, C A B, ...)."""
    n = len(items)
    return [[items[(r + i) % n] for i in range(n)] for r in range(rounds)] if n else []


def cell(values: Sequence[float], digits: int = 0) -> str:
    """`median (min-max)` of `values`: the value alone for one, "-" for none."""
    if not values:
        return "-"
    s = spread(values)
    if s["n"] == 1:
        return f"{s['p50']:,.{digits}f}"
    return f"{s['p50']:,.{digits}f} ({s['min']:,.{digits}f}-{s['max']:,.{digits}f})"


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A plain text table of `rows` (dicts), columns in first-seen order unless given."""
    if not rows:
        return "(no rows)"
    cols = list(columns) if columns else list(dict.fromkeys(k for r in rows for k in r))
    cells = [[_fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(out)


def report(
    name: str,
    rows: Sequence[dict[str, Any]],
    out: str | Path | None,
    *,
    extra: dict[str, Any] | None = None,
    columns: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Print `rows` as a table under `name`, write the JSON to `out` (when given); the JSON."""
    payload = {"benchmark": name, "machine": machine(), "rows": list(rows), **(extra or {})}
    print(f"\n== {name} ==")
    print(table(rows, columns))
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
        print(f"wrote {path}")
    return payload


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != value:  # nan
            return "-"
        return f"{value:.4g}" if abs(value) < 1e3 else f"{value:.0f}"
    return str(value)
