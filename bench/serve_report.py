"""`serve sweep` calls merged into one report: tables, verdicts, plots (docs/SERVE_SWEEP.md).

    python -m bench serve report CALL.json... --md docs/SERVE_SWEEP.md --plots docs/img/serve

Rows merge by (workload, rate, config); failed rows are left out and listed. Per metric: the
median and min-max over calls. A verdict compares a kvo-* configuration with offloading and with
simple (req/s, TTFT p50, p99) and reports the less favourable: **better** / **worse** when the
intervals do not overlap, **within spread** when they do, **1 call** for two lone values. An
interval: min-max over calls; for one call a 95% bootstrap of the per-request TTFTs
(`harness.bootstrap_median_ci`), else the value alone.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import shlex
import sys
from collections import namedtuple
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import bootstrap_median_ci, call_names, read_result, spread  # noqa: E402

KNOWN_CONFIGS = ("none", "offloading", "simple", "kvo-eager", "kvo-lazy")
RIVALS = ("offloading", "simple")
WORKLOAD_ORDER = ("random", "prefix", "chat")


# label, row key, digits, higher is better, the percentile of the per-request TTFTs it is
Metric = namedtuple("Metric", "label key digits higher_is_better q", defaults=(True, None))
METRICS = (
    Metric("req/s", "request_throughput", 2),
    Metric("out tok/s", "output_throughput", 0),
    Metric("TTFT p50", "median_ttft_ms", 1, False, 50.0),
    Metric("TTFT p99", "p99_ttft_ms", 1, False, 99.0),
    Metric("TPOT p50", "median_tpot_ms", 2, False),
    Metric("TPOT p99", "p99_tpot_ms", 2, False),
    Metric("host hit", "host_hit_rate", 3),
    Metric("GPU hit", "gpu_hit_rate", 3),
    Metric("computed", "computed_share", 3, False),
    Metric("from host", "host_cached_share", 3),
    Metric("preempt", "preemptions", 0, False),
)
BY_KEY = {m.key: m for m in METRICS}
VERDICT_METRICS = ("request_throughput", "median_ttft_ms", "p99_ttft_ms")
VERDICTS = ("better", "worse", "within spread", "1 call")
_RANK = {"worse": 0, "within spread": 1, "1 call": 2, "better": 3}  # the least favourable wins


Call = namedtuple("Call", "name machine args servers rows")  # one `serve sweep` JSON
Stat = namedtuple("Stat", "median lo hi n")  # one metric of a cell over the calls that gave it
Interval = namedtuple("Interval", "lo hi basis")  # basis: calls | bootstrap | point


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


def load_calls(paths: Sequence[str | Path]) -> list[Call]:
    """Read the JSON files; names are the file stems (with the folder when stems repeat)."""
    calls = []
    for name, p in call_names([Path(p) for p in paths]).items():
        try:
            data = read_result(p)
        except (OSError, ValueError) as e:
            raise SystemExit(f"{p}: cannot read a serve_sweep JSON: {e}") from e
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            raise SystemExit(f"{p}: no `rows` list: not a `serve sweep` result")
        machine, args, servers = (data.get(k) or {} for k in ("machine", "args", "servers"))
        calls.append(Call(name, machine, args, servers, data["rows"]))
    return calls


def config_key(config: str) -> tuple[int, str]:
    """Known configurations first in their order, then the others by name."""
    return (KNOWN_CONFIGS.index(config), "") if config in KNOWN_CONFIGS else (99, config)


def usable(row: dict[str, Any]) -> bool:
    """A row whose client finished (rc 0) with a summary."""
    return row.get("rc", 0) == 0 and row.get("request_throughput") is not None


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
            sent = int(row.get("completed") or 0) + int(row.get("failed") or 0)
            what = f"{call.name}: {row.get('config')} {row.get('point')}"
            if not usable(row):
                dropped.append(f"{what} rc {row.get('rc')}")
            elif sent < min_requests:
                dropped.append(f"{what} {sent} requests < {min_requests}")
            else:
                k = (row["workload"], float(row["rate"]), row["config"])
                cell = cells.setdefault(k, Cell(row["point"], *k))
                cell.calls.append(call.name)
                cell.rows.append(row)

    def order(k: tuple[str, float, str]) -> tuple:
        w = WORKLOAD_ORDER.index(k[0]) if k[0] in WORKLOAD_ORDER else 99
        return (w, k[0], k[1], config_key(k[2]))

    out: dict[str, dict[str, Cell]] = {}
    for k in sorted(cells, key=order):
        cell = cells[k]
        for m in METRICS:
            if vals := [float(r[m.key]) for r in cell.rows if r.get(m.key) is not None]:
                s = spread(vals)
                cell.stats[m.key] = Stat(s["p50"], s["min"], s["max"], s["n"])
        out.setdefault(cell.point, {})[cell.config] = cell
    return out, dropped


def interval(cell: Cell, key: str) -> Interval | None:
    """The interval a verdict compares (the module docstring): calls, bootstrap or point."""
    st = cell.stats.get(key)
    if st is None:
        return None
    if st.n >= 2:
        return Interval(st.lo, st.hi, "calls")
    q, values = BY_KEY[key].q, cell.rows[0].get("ttfts_ms")
    if q is None or not values:
        return Interval(st.median, st.median, "point")
    lo, hi = bootstrap_median_ci(values, resamples=1000, q=q)
    return Interval(min(lo, st.median), max(hi, st.median), "bootstrap")


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
    mine: tuple[float, Interval, int]  # median, interval, calls
    theirs: tuple[float, Interval, int]

    @property
    def delta_pct(self) -> float:
        return (self.mine[0] / self.theirs[0] - 1) * 100 if self.theirs[0] else math.nan

    def text(self) -> str:
        d = BY_KEY[self.metric].digits
        return (
            f"**{self.verdict}** {self.delta_pct:+.1f}% vs {self.rival}: "
            f"{fmt_iv(*self.mine, d)} vs {fmt_iv(*self.theirs, d)}"
        )


def verdicts(point: dict[str, Cell]) -> list[Verdict]:
    """Each kvo-* configuration against each rival, per VERDICT_METRICS; the least favourable
    verdict is kept (ties: the rival with the better median)."""
    out = []
    for config, cell in point.items():
        if not config.split("+")[0].startswith("kvo"):
            continue
        for key in VERDICT_METRICS:
            m = BY_KEY[key]
            rivals = [point[r] for r in RIVALS if r in point and key in point[r].stats]
            mine = interval(cell, key)
            if not rivals or mine is None:
                continue
            sign = 1 if m.higher_is_better else -1
            rivals.sort(key=lambda c: -sign * c.stats[key].median)  # best median first
            judged = [
                (decide(mine, iv, m.higher_is_better), r, iv)
                for r in rivals
                if (iv := interval(r, key))
            ]
            verdict, rival, theirs = min(judged, key=lambda j: _RANK[j[0]])
            st, rst = cell.stats[key], rival.stats[key]
            out.append(
                Verdict(
                    cell.point,
                    config,
                    key,
                    rival.config,
                    verdict,
                    (st.median, mine, st.n),
                    (rst.median, theirs, rst.n),
                )
            )
    return out


# -- formatting ---------------------------------------------------------------------------------


def fmt(v: float | None, digits: int) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def fmt_stat(st: Stat | None, digits: int) -> str:
    if st is None:
        return "-"
    if st.n > 1:
        return f"{fmt(st.median, digits)} ({fmt(st.lo, digits)}–{fmt(st.hi, digits)})"
    return fmt(st.median, digits)


def fmt_iv(value: float, iv: Interval, n: int, digits: int) -> str:
    what = {"calls": f"{n} calls", "bootstrap": "1 call, bootstrap 95%", "point": "1 call"}
    if iv.basis == "point":
        return f"{fmt(value, digits)} [{what['point']}]"
    return f"{fmt(value, digits)} [{fmt(iv.lo, digits)}–{fmt(iv.hi, digits)}, {what[iv.basis]}]"


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    def cell(text: str, limit: int = 400) -> str:  # no newlines or bare pipes (a failed status)
        text = " ".join(str(text).split()).replace("|", "\\|")
        return text if len(text) <= limit else text[: limit - 1] + "…"

    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return out + ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]


def command_line(args: dict[str, Any]) -> str:
    """The `serve sweep` command a call ran, rebuilt from its `args` (every flag, as parsed)."""
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


def machine_line(calls: Sequence[Call]) -> tuple[str, str]:
    gpus = sorted({g for c in calls for g in c.machine.get("gpu") or []}) or ["no GPU recorded"]
    versions = sorted(
        {str(c.machine["vllm_version"]) for c in calls if c.machine.get("vllm_version")}
    )
    return ", ".join(gpus), f"vLLM {', '.join(versions)}" if versions else "vLLM not recorded"


def date_span(calls: Sequence[Call]) -> str:
    dates = sorted(c.machine["date"] for c in calls if c.machine.get("date"))
    if not dates:
        return "date not recorded"
    a, b = (dt.datetime.fromisoformat(d) for d in (dates[0], dates[-1]))
    if a.date() == b.date():
        return f"{a:%Y-%m-%d %H:%M}–{b:%H:%M} UTC"
    return f"{a:%Y-%m-%d %H:%M} – {b:%Y-%m-%d %H:%M} UTC"


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
    return Report(calls, points, dropped, [v for p in points.values() for v in verdicts(p)])


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
                str(c.machine.get("vllm_version") or "not recorded"),
                ", ".join(c.args.get("configs") or []),
                "; ".join(problems) or "all ok",
            ]
        )
    header = ("call", "date (UTC)", "commit", "GPU", "vLLM", "configuration order", "servers")
    lines += md_table(header, rows)
    lines += ["", "Command lines (rebuilt from each call's `args`):", "", "```"]
    lines += [f"# {c.name}\n{command_line(c.args)}" for c in rep.calls]
    lines += ["```", ""]
    if rep.dropped:
        lines += ["Rows left out: " + "; ".join(rep.dropped), ""]
    lines += [
        "## How to read",
        "",
        "`x (lo–hi)`: the median over calls and the min–max over calls (one call: the value).",
        "Verdicts compare each kvo-* configuration with offloading and with simple on that "
        "metric and report the less favourable one (**better** holds against both). An "
        "interval is the min–max over calls (2+ calls), or for one call the 95% "
        "bootstrap interval (1000 resamples of the per-request values) of TTFT "
        "p50/p99, or the lone value (throughput, chat). **better**/**worse**: the two intervals "
        "do not overlap; **within spread**: they overlap; **1 call**: two lone values.",
        "",
    ]
    for label, point in rep.points.items():
        first = next(iter(point.values()))
        completed = sorted({str(r.get("completed")) for c in point.values() for r in c.rows})
        names = sorted({n for c in point.values() for n in c.calls})
        if first.workload == "chat":
            rate = f"{first.rate:g} concurrent conversations"
        else:
            rate = (
                "all requests at once"
                if math.isinf(first.rate)
                else f"{first.rate:g} req/s offered"
            )
        lines += [
            f"## {label}",
            "",
            f"{first.workload} at {rate}; requests a call: "
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
        cells: dict[str, dict[str, str]] = {}
        for v in (v for v in rep.verdicts if v.point == label):
            cells.setdefault(v.config, {})[v.metric] = v.text()
        if cells:
            header = ["config"] + [BY_KEY[k].label for k in VERDICT_METRICS]
            body = [[c] + [d.get(k, "-") for k in VERDICT_METRICS] for c, d in cells.items()]
            lines += ["Verdict (kvo vs each of offloading/simple, the less favourable shown):", ""]
            lines += md_table(header, body) + [""]
    if rep.verdicts:
        lines += ["## Summary", ""]
        for config in sorted({v.config for v in rep.verdicts}, key=config_key):
            got = [v.verdict for v in rep.verdicts if v.config == config]
            lines.append(
                f"- {config}: of {len(got)} (point, metric) comparisons: "
                + ", ".join(f"{k} {got.count(k)}" for k in VERDICTS if k in got)
            )
        lines += [""]
    if rep.plots:
        lines += ["## Plots (prefix_repetition)", ""]
        for p in rep.plots:
            lines += [f"![{p.stem}]({os.path.relpath(p, md_path.parent)})", ""]
    return "\n".join(lines)


# -- plots --------------------------------------------------------------------------------------

COLORS = {"none": "tab:gray", "offloading": "tab:blue", "simple": "tab:orange",
          "kvo-eager": "tab:green", "kvo-lazy": "tab:red"}  # fmt: skip
EXTRA_COLORS = ("tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")
FIGURES = (  # name, metrics side by side, log y, y label
    ("throughput", ("request_throughput",), False, "completed req/s"),
    ("ttft", ("median_ttft_ms", "p99_ttft_ms"), True, "TTFT (ms, log)"),
    ("tpot", ("median_tpot_ms", "p99_tpot_ms"), False, "TPOT (ms)"),
    ("host_hit", ("host_hit_rate",), False, "host-tier hit rate"),
)


def plot(rep: Report, out_dir: Path, workload: str = "prefix") -> list[Path]:
    """Four small PNGs for `workload` (none when it has no points)."""
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
    finite = [r for r in rates if not math.isinf(r)]
    inf_x = max(finite or [1.0]) * 2
    configs = sorted({c for p in points for c in p}, key=config_key)
    extra = iter(EXTRA_COLORS * 4)
    colors = {c: COLORS.get(c) or next(extra) for c in configs}
    gpus, vllm = machine_line(rep.calls)

    def series(ax: Any, key: str, log_y: bool) -> None:
        for i, config in enumerate(configs):
            xs, ys, err_lo, err_hi = [], [], [], []
            for cell in (p[config] for p in points if config in p and key in p[config].stats):
                st, iv = cell.stats[key], interval(cell, key)
                x = inf_x if math.isinf(cell.rate) else cell.rate
                # a small sideways shift per configuration keeps the bars apart
                xs.append(x * 2 ** (0.04 * (i - (len(configs) - 1) / 2)))
                ys.append(st.median)
                err_lo.append(max(0.0, st.median - (iv.lo if iv else st.median)))
                err_hi.append(max(0.0, (iv.hi if iv else st.median) - st.median))
            if xs:
                ax.errorbar(
                    xs, ys, yerr=[err_lo, err_hi], label=config, color=colors[config],
                    marker="o", ms=4, lw=1.4, capsize=3,
                )  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks([inf_x if math.isinf(r) else r for r in rates])
        ax.set_xticklabels(["inf" if math.isinf(r) else f"{r:g}" for r in rates])
        ax.set_xlabel("offered request rate (req/s)")
        if log_y:
            ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(BY_KEY[key].label, fontsize=10)

    written = []
    for name, keys, log_y, ylabel in FIGURES:
        fig, axes = plt.subplots(
            1, len(keys), figsize=(4.6 * len(keys) + 1.6, 3.8), dpi=100, squeeze=False
        )
        for ax, key in zip(axes[0], keys, strict=True):
            series(ax, key, log_y)
            ax.set_ylabel(ylabel)
            if name == "throughput" and finite:  # what a server that keeps up completes
                ax.plot(finite, finite, ls="--", color="black", lw=0.8, alpha=0.5, label="offered")
        axes[0][-1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
        fig.suptitle(
            f"{workload}: {gpus} · {vllm} · {date_span(rep.calls)}\nbars: min–max over calls; "
            "one call: bootstrap 95% of the per-request values (TTFT, TPOT)",
            fontsize=9,
        )
        fig.tight_layout()
        path = out_dir / f"serve_{workload}_{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="serve report", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="`serve sweep` JSON files (one per call)")
    p.add_argument("--md", required=True, help="the markdown report to write")
    p.add_argument("--plots", help="folder for the PNG plots (none drawn without it)")
    p.add_argument(
        "--min-requests",
        type=int,
        default=0,
        help="leave out rows of points that sent fewer requests (listed)",
    )
    argv = sys.argv[1:] if argv is None else argv
    a = p.parse_args(argv)
    rep = build(a.files, a.min_requests)
    if not rep.points:
        raise SystemExit(f"no usable rows in {', '.join(a.files)}")
    md_path = Path(a.md)
    if a.plots:
        rep.plots = plot(rep, Path(a.plots))
    command = shlex.join(["python", "-m", "bench", "serve", "report", *argv])
    text = markdown(rep, md_path, command)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
