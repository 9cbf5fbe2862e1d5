"""Merge the JSON of several `serve sweep` calls into one report: tables, verdicts, plots.

    python -m bench serve_report bench/out/serve/a1.json a2.json b1.json \\
        --md docs/SERVE_SWEEP.md --plots docs/img/serve

Rows merge by (workload, rate, config) across calls (rows whose client failed are left out and
listed). Per metric: the median over calls, the min-max over calls (the spread) and n calls;
a table per point prints `x (lo-hi)` when more than one call gave a value.

Each side of a comparison has an interval for a metric:

    calls      n >= 2 calls: the min-max of the per-call values
    bootstrap  one call, TTFT/TPOT with the call's per-request list (ttfts_ms, tpots_ms): the
               95% percentile-bootstrap interval of that statistic (median or p99, numpy's
               linear percentile as vLLM's summary uses), 1000 resamples of the per-request
               values, seeded (numpy default_rng) from the point, config and metric
    point      one call and nothing to resample (throughput has no per-request distribution,
               chat points have no per-request lists): the value alone, lo = hi

Verdict of a kvo-* configuration against each of offloading/simple on that metric (higher
req/s, lower TTFT p50/p99), at one point; the least favourable of the two is reported (so
"better" means better than both, each outside its spread; ties name the better median):

    better / worse   the two closed intervals do not overlap ("outside the spread"), and the
                     kvo one lies on the good / bad side
    1 call           both sides are `point` intervals: no spread to judge by
    within spread    otherwise (the intervals overlap: noise can decide the ranking)

Plots (matplotlib, Agg) for the prefix workload: throughput, TTFT p50/p99 (log y), TPOT p50/p99,
host hit rate against the offered rate, a line per configuration, bars the interval above.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import lzma
import math
import os
import shlex
import sys
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import read_result, result_stem, spread  # noqa: E402

KNOWN_CONFIGS = ("none", "offloading", "simple", "kvo-eager", "kvo-lazy")
RIVALS = ("offloading", "simple")
WORKLOAD_ORDER = ("random", "prefix", "chat")
RESAMPLES = 1000


@dataclass(frozen=True)
class Metric:
    label: str
    key: str
    digits: int
    higher_is_better: bool = True
    per_request: str | None = None  # the row's per-request list this statistic comes from
    q: float = 50.0  # which percentile of it


METRICS = (
    Metric("req/s", "request_throughput", 2),
    Metric("out tok/s", "output_throughput", 0),
    Metric("TTFT p50", "median_ttft_ms", 1, False, "ttfts_ms", 50.0),
    Metric("TTFT p99", "p99_ttft_ms", 1, False, "ttfts_ms", 99.0),
    Metric("TPOT p50", "median_tpot_ms", 2, False, "tpots_ms", 50.0),
    Metric("TPOT p99", "p99_tpot_ms", 2, False, "tpots_ms", 99.0),
    Metric("host hit", "host_hit_rate", 3),
    Metric("GPU hit", "gpu_hit_rate", 3),
    # once per request, by source (calls from before these counters leave them empty)
    Metric("computed", "computed_share", 3, False),
    Metric("from host", "host_cached_share", 3),
    Metric("preempt", "preemptions", 0, False),
)
BY_KEY = {m.key: m for m in METRICS}
VERDICT_METRICS = ("request_throughput", "median_ttft_ms", "p99_ttft_ms")
VERDICTS = ("better", "worse", "within spread", "1 call")


# -- loading and merging -------------------------------------------------------------------------


@dataclass
class Call:
    """One serve_sweep JSON: where and how it ran."""

    name: str
    path: str
    machine: dict[str, Any]
    args: dict[str, Any]
    servers: dict[str, Any]
    rows: list[dict[str, Any]]

    @property
    def vllm_version(self) -> str:
        return vllm_version(self.machine, self.args, self.servers)


@dataclass
class Stat:
    """One metric of one (point, config) over the calls that gave a value."""

    median: float
    lo: float
    hi: float
    n: int


@dataclass
class Interval:
    lo: float
    hi: float
    basis: str  # calls | bootstrap | point


@dataclass
class Cell:
    """One configuration at one point, merged over calls."""

    point: str
    workload: str
    rate: float
    config: str
    calls: list[str] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    stats: dict[str, Stat] = field(default_factory=dict)

    def samples(self, key: str) -> list[list[float]] | None:
        """The per-request lists of every call for a metric, or None if any call lacks one."""
        lists = [r.get(key) for r in self.rows]
        return [list(x) for x in lists] if lists and all(lists) else None


def vllm_version(machine: dict[str, Any], args: dict[str, Any], servers: dict[str, Any]) -> str:
    """vLLM's version as the call recorded it: machine/args if serve_sweep wrote it there, else
    what kvoffload's connector reported to its sidecar (sidecar_stats.connectorStatus)."""
    for d in (machine, args):
        for k in ("vllm_version", "vllm"):
            if d.get(k):
                return str(d[k])
    for server in servers.values():
        status = ((server or {}).get("sidecar_stats") or {}).get("connectorStatus")
        try:
            for entry in json.loads(status) if status else []:
                if entry.get("vllm_version"):
                    return str(entry["vllm_version"])
        except (ValueError, TypeError, AttributeError):
            continue
    return ""


def load_calls(paths: Sequence[str | Path]) -> list[Call]:
    """Read the JSON files; names are the file stems (with the folder when stems repeat)."""
    paths = [Path(p) for p in paths]
    stems = [result_stem(p) for p in paths]
    calls = []
    for p, stem in zip(paths, stems, strict=True):
        try:
            data = read_result(p)
        except (OSError, ValueError, lzma.LZMAError) as e:
            raise SystemExit(f"{p}: cannot read a serve_sweep JSON: {e}") from e
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            raise SystemExit(f"{p}: no `rows` list: not a `serve sweep` result")
        name = stem if stems.count(stem) == 1 else f"{p.parent.name}/{stem}"
        calls.append(
            Call(
                name,
                str(p),
                data.get("machine") or {},
                data.get("args") or {},
                data.get("servers") or {},
                data["rows"],
            )
        )
    return calls


def config_key(config: str) -> tuple[int, str]:
    """Known configurations first in their order, then the others by name."""
    return (KNOWN_CONFIGS.index(config), "") if config in KNOWN_CONFIGS else (99, config)


def point_key(workload: str, rate: float) -> tuple[int, str, float]:
    rank = WORKLOAD_ORDER.index(workload) if workload in WORKLOAD_ORDER else 99
    return (rank, workload, rate)


def is_kvo(config: str) -> bool:
    return config.split("+")[0].startswith("kvo")


def usable(row: dict[str, Any]) -> bool:
    """A row whose client finished (rc 0) with a summary."""
    return row.get("rc", 0) == 0 and row.get("request_throughput") is not None


def requests_of(row: dict[str, Any]) -> int:
    """The requests a row's point sent (completed + failed)."""
    return int(row.get("completed") or 0) + int(row.get("failed") or 0)


def merge(
    calls: Sequence[Call], min_requests: int = 0
) -> tuple[dict[str, dict[str, Cell]], list[str]]:
    """point label -> config -> Cell, both in report order; and the rows left out (why).
    Rows of points that sent fewer than `min_requests` are left out: a point with fewer
    requests is another workload (its first sightings of each prefix weigh more)."""
    cells: dict[tuple[str, float, str], Cell] = {}
    dropped = []
    for call in calls:
        for row in call.rows:
            if not usable(row):
                dropped.append(
                    f"{call.name}: {row.get('config')} {row.get('point')} rc {row.get('rc')}"
                )
                continue
            if requests_of(row) < min_requests:
                dropped.append(
                    f"{call.name}: {row.get('config')} {row.get('point')} "
                    f"{requests_of(row)} requests < {min_requests}"
                )
                continue
            rate = float(row["rate"])
            k = (row["workload"], rate, row["config"])
            cell = cells.setdefault(k, Cell(row["point"], row["workload"], rate, row["config"]))
            cell.calls.append(call.name)
            cell.rows.append(row)
    out: dict[str, dict[str, Cell]] = {}
    for k in sorted(cells, key=lambda k: (point_key(k[0], k[1]), config_key(k[2]))):
        cell = cells[k]
        for m in METRICS:
            vals = [float(r[m.key]) for r in cell.rows if r.get(m.key) is not None]
            if vals:
                s = spread(vals)
                cell.stats[m.key] = Stat(s["p50"], s["min"], s["max"], s["n"])
        out.setdefault(cell.point, {})[cell.config] = cell
    return out, dropped


# -- intervals, verdicts ---------------------------------------------------------------------------


def _seed(*parts: str) -> int:
    return zlib.crc32("|".join(parts).encode())


def bootstrap_stats(
    samples: Sequence[Sequence[float]],
    q: float,
    rng: np.random.Generator,
    resamples: int = RESAMPLES,
) -> np.ndarray:
    """`resamples` values of: the median over calls of each call's q-th percentile of its
    per-request values resampled with replacement (one call: just that percentile)."""
    per_call = []
    for values in samples:
        a = np.asarray(values, dtype=float)
        if a.size == 0:
            raise ValueError("bootstrap of an empty sample")
        idx = rng.integers(0, a.size, size=(resamples, a.size))
        per_call.append(np.percentile(a[idx], q, axis=1))
    return np.median(np.stack(per_call), axis=0)


def bootstrap_interval(
    samples: Sequence[Sequence[float]], q: float, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """The `level` percentile-bootstrap interval of the q-th percentile (see bootstrap_stats)."""
    stats = bootstrap_stats(samples, q, np.random.default_rng(seed))
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(stats, [tail, 100 - tail])
    return float(lo), float(hi)


def interval(cell: Cell, key: str) -> Interval | None:
    """The interval a verdict compares (module docstring): calls, bootstrap or point."""
    st = cell.stats.get(key)
    if st is None:
        return None
    if st.n >= 2:
        return Interval(st.lo, st.hi, "calls")
    m = BY_KEY[key]
    samples = cell.samples(m.per_request) if m.per_request else None
    if samples:
        lo, hi = bootstrap_interval(samples, m.q, _seed(cell.point, cell.config, key))
        return Interval(min(lo, st.median), max(hi, st.median), "bootstrap")
    return Interval(st.median, st.median, "point")


def decide(mine: Interval, theirs: Interval, higher_is_better: bool) -> str:
    """better / worse (intervals disjoint), 1 call (two lone values), within spread."""
    if mine.basis == theirs.basis == "point":
        return "1 call"
    if mine.lo > theirs.hi:
        return "better" if higher_is_better else "worse"
    if mine.hi < theirs.lo:
        return "worse" if higher_is_better else "better"
    return "within spread"


@dataclass
class Verdict:
    point: str
    config: str
    metric: str
    rival: str
    verdict: str
    value: float
    interval: Interval
    n: int
    rival_value: float
    rival_interval: Interval
    rival_n: int

    @property
    def delta_pct(self) -> float:
        return (self.value / self.rival_value - 1) * 100 if self.rival_value else math.nan

    def line(self) -> str:
        m = BY_KEY[self.metric]
        return (
            f"{self.point} {self.config} {m.label}: {self.verdict} "
            f"({fmt_iv(self.value, self.interval, self.n, m.digits)} vs {self.rival} "
            f"{fmt_iv(self.rival_value, self.rival_interval, self.rival_n, m.digits)}, "
            f"{self.delta_pct:+.1f}%)"
        )


# The verdict reported against several rivals is the least favourable one: "better" must hold
# against each of them, not only against the one whose median is best (a rival with one call and
# a good median must not hide another whose range reaches kvoffload's).
_VERDICT_RANK = {"worse": 0, "within spread": 1, "1 call": 2, "better": 3}


def verdicts(point: dict[str, Cell]) -> list[Verdict]:
    """Each kvo-* configuration against each rival, per VERDICT_METRICS; the least favourable
    verdict is kept (ties: the rival with the better median)."""
    out = []
    for config, cell in point.items():
        if not is_kvo(config):
            continue
        for key in VERDICT_METRICS:
            m = BY_KEY[key]
            rivals = [point[r] for r in RIVALS if r in point and key in point[r].stats]
            mine = interval(cell, key)
            if not rivals or mine is None:
                continue
            sign = 1 if m.higher_is_better else -1
            rivals.sort(key=lambda c: -sign * c.stats[key].median)  # best median first
            judged = []
            for r in rivals:
                iv = interval(r, key)
                assert iv is not None
                judged.append((decide(mine, iv, m.higher_is_better), r, iv))
            verdict, rival, theirs = min(judged, key=lambda j: _VERDICT_RANK[j[0]])
            out.append(
                Verdict(
                    cell.point,
                    config,
                    key,
                    rival.config,
                    verdict,
                    cell.stats[key].median,
                    mine,
                    cell.stats[key].n,
                    rival.stats[key].median,
                    theirs,
                    rival.stats[key].n,
                )
            )
    return out


# -- formatting ------------------------------------------------------------------------------------


def fmt(v: float, digits: int) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def fmt_stat(st: Stat | None, digits: int) -> str:
    if st is None:
        return "-"
    if st.n > 1:
        return f"{fmt(st.median, digits)} ({fmt(st.lo, digits)}–{fmt(st.hi, digits)})"
    return fmt(st.median, digits)


def fmt_iv(value: float, iv: Interval, n: int, digits: int) -> str:
    basis = {"calls": f"{n} calls", "bootstrap": "1 call, bootstrap 95%", "point": "1 call"}
    what = basis[iv.basis]
    if iv.basis == "point":
        return f"{fmt(value, digits)} [{what}]"
    return f"{fmt(value, digits)} [{fmt(iv.lo, digits)}–{fmt(iv.hi, digits)}, {what}]"


def md_cell(text: str, limit: int = 400) -> str:
    """One table cell: no newlines or bare pipes (a failed server's status has both)."""
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return out + ["| " + " | ".join(md_cell(c) for c in r) + " |" for r in rows]


def command_line(args: dict[str, Any]) -> str:
    """The serve_sweep command a call ran, rebuilt from its `args` (every flag, as parsed)."""
    parts = ["python", "-m", "bench", "serve", "sweep"]
    for k, v in args.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            parts += [flag] if v else []
        elif isinstance(v, list) and k == "serve_arg":
            parts += [f"{flag}={x}" for x in v]
        elif isinstance(v, list):
            parts += [flag, ",".join(f"{x:g}" if isinstance(x, float) else str(x) for x in v)]
        elif v is not None:
            parts += [flag, f"{v:g}" if isinstance(v, float) else str(v)]
    return " ".join(shlex.quote(p) for p in parts)


def vllm_command(argv: Sequence[str]) -> str:
    """A server's `vllm serve ...` as a user types it: the interpreter and the bench shim that
    ran vLLM's CLI left out."""
    start = next((i for i, x in enumerate(argv) if i and x in ("serve", "bench")), 0)
    shown = ["vllm", *argv[start:]] if start else list(argv)
    return " ".join(shlex.quote(x) for x in shown)


def machine_line(calls: Sequence[Call]) -> tuple[str, str]:
    gpus = sorted({g for c in calls for g in c.machine.get("gpu") or []}) or ["no GPU recorded"]
    versions = sorted({c.vllm_version for c in calls if c.vllm_version})
    vllm = f"vLLM {', '.join(versions)}" if versions else "vLLM version not recorded"
    return ", ".join(gpus), vllm


def date_span(calls: Sequence[Call]) -> str:
    dates = sorted(c.machine["date"] for c in calls if c.machine.get("date"))
    if not dates:
        return "date not recorded"
    a, b = (dt.datetime.fromisoformat(d) for d in (dates[0], dates[-1]))
    if a.date() == b.date():
        return f"{a:%Y-%m-%d %H:%M}–{b:%H:%M} UTC"
    return f"{a:%Y-%m-%d %H:%M} – {b:%Y-%m-%d %H:%M} UTC"


# -- the report ------------------------------------------------------------------------------------


@dataclass
class Report:
    calls: list[Call]
    points: dict[str, dict[str, Cell]]
    dropped: list[str]
    verdicts: list[Verdict]
    plots: list[Path] = field(default_factory=list)


def build(paths: Sequence[str | Path], min_requests: int = 0) -> Report:
    calls = load_calls(paths)
    points, dropped = merge(calls, min_requests)
    vs = [v for p in points.values() for v in verdicts(p)]
    return Report(calls, points, dropped, vs)


def markdown(rep: Report, md_path: Path, command: str) -> str:
    gpus, vllm = machine_line(rep.calls)
    commits = sorted({c.machine.get("commit") or "?" for c in rep.calls})
    lines = [
        "# Serving sweep: vLLM's OpenAI server under load, merged over calls",
        "",
        f"- Machine: {gpus}; {vllm}",
        f"- Dates: {date_span(rep.calls)}; commits: {', '.join(commits)}",
        f"- Calls: {len(rep.calls)} ({', '.join(c.name for c in rep.calls)})",
        f"- Report: `{command}`",
        "",
        "## Calls",
        "",
    ]
    rows = []
    for c in rep.calls:
        problems = [
            f"{k}: {v.get('status') or 'cut: no status (the call ended first)'}"
            for k, v in c.servers.items()
            if v.get("status") != "ok"
        ]
        rows.append(
            [
                c.name,
                c.machine.get("date", "?"),
                c.machine.get("commit", "?"),
                ", ".join(c.machine.get("gpu") or ["?"]),
                c.vllm_version or "not recorded",
                ", ".join(c.args.get("configs") or []),
                "; ".join(problems) or "all ok",
            ]
        )
    header = ("call", "date (UTC)", "commit", "GPU", "vLLM", "configuration order", "servers")
    lines += md_table(header, rows)
    lines += ["", "Command lines (rebuilt from each call's `args`):", "", "```"]
    lines += [f"# {c.name}\n{command_line(c.args)}" for c in rep.calls]
    lines += ["```", ""]
    lines += ["<details><summary>vllm serve command lines</summary>", "", "```"]
    for c in rep.calls:
        for config, s in c.servers.items():
            if s.get("argv"):
                lines.append(f"# {c.name} {config}\n{vllm_command(s['argv'])}")
    lines += ["```", "", "</details>", ""]
    if rep.dropped:
        lines += ["Rows left out: " + "; ".join(rep.dropped), ""]
    lines += [
        "## How to read",
        "",
        "`x (lo–hi)`: the median over calls and the min–max over calls (one call: the value).",
        "Verdicts compare each kvo-* configuration with offloading and with simple on that "
        "metric and report the less favourable one (**better** holds against both). An "
        "interval is the min–max over calls (2+ calls), or for one call the 95% "
        f"bootstrap interval ({RESAMPLES} resamples of the per-request values) of TTFT "
        "p50/p99, or the lone value (throughput, chat). **better**/**worse**: the two intervals "
        "do not overlap; **within spread**: they overlap; **1 call**: two lone values.",
        "",
    ]
    by_point: dict[str, list[Verdict]] = {}
    for v in rep.verdicts:
        by_point.setdefault(v.point, []).append(v)
    for label, point in rep.points.items():
        first = next(iter(point.values()))
        completed = sorted({str(r.get("completed")) for c in point.values() for r in c.rows})
        names = sorted({n for c in point.values() for n in c.calls})
        lines += [
            f"## {label}",
            "",
            f"{first.workload} at {fmt_rate(first.workload, first.rate)}; requests a call: "
            f"{', '.join(completed)}; calls: {', '.join(names)}",
            "",
        ]
        header = ["config", "calls"] + [m.label for m in METRICS]
        body = [
            [cell.config, str(len(cell.calls))]
            + [fmt_stat(cell.stats.get(m.key), m.digits) for m in METRICS]
            for cell in point.values()
        ]
        lines += md_table(header, body) + [""]
        pv = by_point.get(label, [])
        if pv:
            cells: dict[str, dict[str, str]] = {}
            for v in pv:
                m = BY_KEY[v.metric]
                cells.setdefault(v.config, {})[v.metric] = (
                    f"**{v.verdict}** {v.delta_pct:+.1f}% vs {v.rival}: "
                    f"{fmt_iv(v.value, v.interval, v.n, m.digits)} vs "
                    f"{fmt_iv(v.rival_value, v.rival_interval, v.rival_n, m.digits)}"
                )
            header = ["config"] + [BY_KEY[k].label for k in VERDICT_METRICS]
            body = [[c] + [d.get(k, "-") for k in VERDICT_METRICS] for c, d in cells.items()]
            lines += ["Verdict (kvo vs each of offloading/simple, the less favourable shown):", ""]
            lines += md_table(header, body) + [""]
    if rep.verdicts:
        lines += ["## Summary", ""]
        for config in sorted({v.config for v in rep.verdicts}, key=config_key):
            counts: dict[str, int] = {}
            for v in rep.verdicts:
                if v.config == config:
                    counts[v.verdict] = counts.get(v.verdict, 0) + 1
            total = sum(counts.values())
            lines.append(
                f"- {config}: of {total} (point, metric) comparisons: "
                + ", ".join(f"{k} {counts[k]}" for k in VERDICTS if k in counts)
            )
        lines += [""]
    if rep.plots:
        lines += ["## Plots (prefix_repetition)", ""]
        for p in rep.plots:
            rel = os.path.relpath(p, md_path.parent)
            lines += [f"![{p.stem}]({rel})", ""]
    return "\n".join(lines)


def fmt_rate(workload: str, rate: float) -> str:
    if workload == "chat":
        return f"{rate:g} concurrent conversations"
    return "all requests at once" if math.isinf(rate) else f"{rate:g} req/s offered"


# -- plots -----------------------------------------------------------------------------------------

COLORS = {
    "none": "tab:gray",
    "offloading": "tab:blue",
    "simple": "tab:orange",
    "kvo-eager": "tab:green",
    "kvo-lazy": "tab:red",
}
EXTRA_COLORS = ("tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")


def plot(rep: Report, out_dir: Path, workload: str = "prefix") -> list[Path]:
    """Up to four small PNGs for `workload` (none when it has no points)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("plots need matplotlib: pip install 'kvoffload[bench]'") from e
    points = [p for p in rep.points.values() if next(iter(p.values())).workload == workload]
    if not points:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    rates = sorted({next(iter(p.values())).rate for p in points})
    finite = [r for r in rates if not math.isinf(r)] or [1.0]
    inf_x = max(finite) * 2

    def xpos(rate: float) -> float:
        return inf_x if math.isinf(rate) else rate

    configs = sorted({c for p in points for c in p}, key=config_key)
    extra = iter(EXTRA_COLORS * 4)
    colors = {c: COLORS.get(c) or next(extra) for c in configs}
    gpus, vllm = machine_line(rep.calls)
    title = f"{gpus} · {vllm} · {date_span(rep.calls)}"

    def series(ax: Any, key: str, log_y: bool) -> None:
        for i, config in enumerate(configs):
            xs, ys, err_lo, err_hi = [], [], [], []
            for p in points:
                cell = p.get(config)
                if cell is None or key not in cell.stats:
                    continue
                st = cell.stats[key]
                iv = interval(cell, key)
                lo, hi = (iv.lo, iv.hi) if iv else (st.median, st.median)
                # a small sideways shift per configuration keeps the bars apart
                xs.append(xpos(cell.rate) * 2 ** (0.04 * (i - (len(configs) - 1) / 2)))
                ys.append(st.median)
                err_lo.append(max(0.0, st.median - lo))
                err_hi.append(max(0.0, hi - st.median))
            if xs:
                ax.errorbar(
                    xs, ys, yerr=[err_lo, err_hi], label=config, color=colors[config],
                    marker="o", ms=4, lw=1.4, capsize=3,
                )  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks([xpos(r) for r in rates])
        ax.set_xticklabels(["inf" if math.isinf(r) else f"{r:g}" for r in rates])
        ax.set_xlabel("offered request rate (req/s)")
        if log_y:
            ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(BY_KEY[key].label, fontsize=10)

    figures: list[tuple[str, Sequence[str], bool, str, Callable[[Any], None] | None]] = [
        ("throughput", ("request_throughput",), False, "completed req/s", _ideal(rates)),
        ("ttft", ("median_ttft_ms", "p99_ttft_ms"), True, "TTFT (ms, log)", None),
        ("tpot", ("median_tpot_ms", "p99_tpot_ms"), False, "TPOT (ms)", None),
        ("host_hit", ("host_hit_rate",), False, "host-tier hit rate", None),
    ]
    written = []
    for name, keys, log_y, ylabel, extra_draw in figures:
        fig, axes = plt.subplots(1, len(keys), figsize=(4.6 * len(keys) + 1.6, 3.8), dpi=100)
        axes = np.atleast_1d(axes)
        for ax, key in zip(axes, keys, strict=True):
            series(ax, key, log_y)
            ax.set_ylabel(ylabel)
            if extra_draw:
                extra_draw(ax)
        axes[-1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
        fig.suptitle(
            f"{workload}: {title}\nbars: min–max over calls; one call: bootstrap 95% of the "
            "per-request values (TTFT, TPOT)",
            fontsize=9,
        )
        fig.tight_layout()
        path = out_dir / f"serve_{workload}_{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def _ideal(rates: Sequence[float]) -> Callable[[Any], None]:
    """The offered rate as a dashed line: what a server that keeps up completes."""
    finite = [r for r in rates if not math.isinf(r)]

    def draw(ax: Any) -> None:
        if finite:
            ax.plot(finite, finite, ls="--", color="black", lw=0.8, alpha=0.5, label="offered")

    return draw


# -- main ------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("files", nargs="+", help="`serve sweep` JSON files (one per call)")
    p.add_argument("--md", required=True, help="the markdown report to write")
    p.add_argument("--plots", help="folder for the PNG plots (none drawn without it)")
    p.add_argument(
        "--min-requests",
        type=int,
        default=0,
        help="leave out rows of points that sent fewer requests (listed as left out)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    rep = build(a.files, a.min_requests)
    if not rep.points:
        raise SystemExit(f"no usable rows in {', '.join(a.files)}")
    md_path = Path(a.md)
    if a.plots:
        rep.plots = plot(rep, Path(a.plots))
    command = " ".join(
        shlex.quote(x) for x in ["python", "-m", "bench", "serve_report", *(argv or sys.argv[1:])]
    )
    text = markdown(rep, md_path, command)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(text + "\n")
    print(text)
    print("\nverdicts:")
    for v in rep.verdicts:
        print(f"  {v.line()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
