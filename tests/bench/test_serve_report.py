"""`serve report` (bench/serve_report.py): merging `serve sweep` calls, verdicts, plots.

Synthetic calls are written with `serve sweep`'s JSON schema (machine, args, servers, rows with
the client's summary, per-request ttfts_ms/tpots_ms and the counters' rates); the committed
calls of an H100 sweep (tests/bench/data/serve/*.json.xz) go through the same command.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "tests" / "bench" / "data" / "serve"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


sys.path.insert(0, str(ROOT / "bench"))

import serve_report as sr  # noqa: E402
from harness import bootstrap_median_ci, read_result, result_stem  # noqa: E402


def row(
    config: str,
    workload: str,
    rate: float,
    *,
    order: int = 0,
    ttft_ms: float = 100.0,
    n: int = 60,
    seed: int = 0,
    lists: bool = True,
    **summary: Any,
) -> dict[str, Any]:
    """A serve_sweep row: per-request lists drawn around ttft_ms, the summary computed from them
    as vLLM's does (np.median / np.percentile), any summary field overridable."""
    rng = np.random.default_rng(seed)
    ttfts = np.round(ttft_ms * rng.lognormal(0, 0.15, n), 2)
    tpots = np.round(10 * rng.lognormal(0, 0.1, n), 3)
    out: dict[str, Any] = {
        "config": config,
        "workload": workload,
        "rate": rate,
        "point": f"{workload}@{rate:g}",
        "rc": 0,
        "wall_s": 10.0,
        "completed": n,
        "failed": 0,
        "duration": n / rate,
        "request_throughput": rate * 0.98,
        "output_throughput": rate * 0.98 * 64,
        "median_ttft_ms": float(np.median(ttfts)),
        "p99_ttft_ms": float(np.percentile(ttfts, 99)),
        "median_tpot_ms": float(np.median(tpots)),
        "p99_tpot_ms": float(np.percentile(tpots, 99)),
        "gpu_hit_rate": 0.2,
        "host_hit_rate": None if config == "none" else 0.5,
        "host_hit_share": 0.0 if config == "none" else 0.3,
        "preemptions": 0.0,
        "counters": {},
        "order": order,
    }
    if lists and workload != "chat":
        out["ttfts_ms"] = ttfts.tolist()
        out["tpots_ms"] = tpots.tolist()
    out.update(summary)
    return out


def write_call(
    tmp: Path,
    name: str,
    rows: list[dict[str, Any]],
    date: str = "2026-11-26T04:00:00+00:00",
    **args: Any,
) -> Path:
    configs = list(dict.fromkeys(r["config"] for r in rows))
    data = {
        "benchmark": "serve_sweep",
        "machine": {"host": "vm", "cpus": 16, "date": date, "commit": "abc1234", "gpu": ["H100"]},
        "args": {"configs": configs, "rates": [2.0, 8.0], "serve_arg": [], "tp": 1}
        | {"num_prefixes": 24, "chat_turns": 3}
        | args,
        "points": [],
        "servers": {c: {"argv": ["vllm", "serve", c], "status": "ok"} for c in configs},
        "rows": rows,
    }
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(data))
    return path


def verdict_of(rep: Any, point: str, config: str, metric: str) -> Any:
    found = [v for v in rep.verdicts if (v.point, v.config, v.metric) == (point, config, metric)]
    assert len(found) == 1, found
    return found[0]


def test_merge_gives_the_median_and_range_over_calls_and_drops_failed_rows(tmp_path):
    thr = {"c1": 10.0, "c2": 12.0, "c3": 11.0}
    ttft = {"c1": 90.0, "c2": 130.0, "c3": 100.0}
    paths = []
    for i, name in enumerate(thr):
        rows = [
            row(
                "offloading",
                "prefix",
                8.0,
                seed=i,
                request_throughput=thr[name],
                median_ttft_ms=ttft[name],
            )
        ]
        if name == "c2":  # a client that timed out: left out, listed
            rows.append(row("simple", "prefix", 8.0, rc="timeout", request_throughput=None))
        paths.append(write_call(tmp_path, name, rows))
    rep = sr.build(paths)
    cell = rep.points["prefix@8"]["offloading"]
    assert cell.calls == ["c1", "c2", "c3"]
    assert cell.stats["request_throughput"] == sr.Stat(11.0, 10.0, 12.0, 3)
    assert cell.stats["median_ttft_ms"] == sr.Stat(100.0, 90.0, 130.0, 3)
    assert "simple" not in rep.points["prefix@8"]
    assert rep.dropped == ["c2: simple prefix@8 rc timeout"]
    assert sr.fmt_stat(cell.stats["request_throughput"], 2) == "11.00 (10.00–12.00)"
    assert sr.fmt_stat(sr.Stat(5.0, 5.0, 5.0, 1), 2) == "5.00"


def test_verdicts_better_worse_within_spread_and_one_call(tmp_path):
    # two calls each: throughput and TTFT compared by their min-max over calls
    per_call = {
        # config: (req/s, TTFT p50, TTFT p99) per call
        "offloading": [(10.0, 100.0, 300.0), (11.0, 105.0, 320.0)],
        "simple": [(12.0, 120.0, 280.0), (13.0, 130.0, 310.0)],
        "kvo-eager": [(15.0, 200.0, 290.0), (16.0, 210.0, 330.0)],
    }
    keys = ("request_throughput", "median_ttft_ms", "p99_ttft_ms")
    paths = []
    for i in range(2):
        rows = [
            row(c, "prefix", 16.0, order=j, seed=10 * i + j, **dict(zip(keys, v[i], strict=True)))
            for j, (c, v) in enumerate(per_call.items())
        ]
        # one call only: throughput lone values, TTFT from a bootstrap of 400 requests each
        if i == 0:
            rows += [
                row("offloading", "prefix", 32.0, ttft_ms=100.0, n=400, seed=1),
                row("kvo-eager", "prefix", 32.0, ttft_ms=50.0, n=400, seed=2),
                row("kvo-lazy", "prefix", 32.0, ttft_ms=100.0, n=400, seed=3),
            ]
        paths.append(write_call(tmp_path, f"call{i}", rows))
    rep = sr.build(paths)

    thr = verdict_of(rep, "prefix@16", "kvo-eager", "request_throughput")
    assert (thr.verdict, thr.rival) == ("better", "simple")  # 15-16 above simple's 12-13
    p50 = verdict_of(rep, "prefix@16", "kvo-eager", "median_ttft_ms")
    assert (p50.verdict, p50.rival) == ("worse", "offloading")  # 200-210 above 100-105
    assert p50.mine[1] == sr.Interval(200.0, 210.0, "calls")
    p99 = verdict_of(rep, "prefix@16", "kvo-eager", "p99_ttft_ms")
    assert (p99.verdict, p99.rival) == ("within spread", "simple")  # 290-330 meets 280-310

    assert verdict_of(rep, "prefix@32", "kvo-eager", "request_throughput").verdict == "1 call"
    fast = verdict_of(rep, "prefix@32", "kvo-eager", "median_ttft_ms")
    assert fast.verdict == "better" and fast.mine[1].basis == "bootstrap"
    same = verdict_of(rep, "prefix@32", "kvo-lazy", "median_ttft_ms")
    assert same.verdict == "within spread"
    assert "within spread" in same.text() and "bootstrap 95%" in same.text()


def test_better_must_hold_against_each_rival_not_only_the_best_median(tmp_path):
    # simple has the better median throughput (one call) but offloading's range over two calls
    # reaches kvoffload's: the verdict is "within spread" against offloading, not "better"
    calls = {
        "a": {"kvo-eager": 15.6, "offloading": 13.0, "simple": 14.4},
        "b": {"kvo-eager": 15.7, "offloading": 15.7},
    }
    paths = [
        write_call(
            tmp_path,
            name,
            [
                row(c, "prefix", 32.0, seed=j, request_throughput=v)
                for j, (c, v) in enumerate(vs.items())
            ],
        )
        for name, vs in calls.items()
    ]
    rep = sr.build(paths)
    v = verdict_of(rep, "prefix@32", "kvo-eager", "request_throughput")
    assert (v.verdict, v.rival) == ("within spread", "offloading")
    assert v.theirs[1] == sr.Interval(13.0, 15.7, "calls")


def test_min_requests_leaves_out_points_with_fewer_requests(tmp_path):
    small = write_call(tmp_path, "small", [row("offloading", "prefix", 8.0, n=96, ttft_ms=300.0)])
    big = write_call(tmp_path, "big", [row("offloading", "prefix", 8.0, n=192, ttft_ms=100.0)])
    merged = sr.build([small, big])
    assert merged.points["prefix@8"]["offloading"].calls == ["small", "big"]
    rep = sr.build([small, big], min_requests=100)
    assert rep.points["prefix@8"]["offloading"].calls == ["big"]
    assert rep.dropped == ["small: offloading prefix@8 96 requests < 100"]
    md = tmp_path / "r.md"
    assert sr.main([str(small), str(big), "--md", str(md), "--min-requests", "100"]) == 0
    assert "Rows left out: small: offloading prefix@8 96 requests < 100" in md.read_text()


def test_decide_is_symmetric_in_direction():
    a, b = sr.Interval(1.0, 2.0, "calls"), sr.Interval(3.0, 4.0, "calls")
    assert sr.decide(a, b, higher_is_better=True) == "worse"
    assert sr.decide(a, b, higher_is_better=False) == "better"
    assert sr.decide(b, a, higher_is_better=True) == "better"
    touching = sr.Interval(2.0, 3.0, "calls")
    assert sr.decide(a, touching, higher_is_better=True) == "within spread"  # closed intervals
    lone = sr.Interval(5.0, 5.0, "point")
    assert sr.decide(lone, sr.Interval(4.0, 4.0, "point"), True) == "1 call"
    assert sr.decide(lone, a, True) == "better"  # a lone value outside a measured range


@pytest.mark.parametrize("n", [20, 48, 200])
@pytest.mark.parametrize("q", [50.0, 99.0])
def test_bootstrap_interval_contains_the_sample_statistic_and_is_seeded(n, q):
    values = np.random.default_rng(n).lognormal(4, 0.5, n).tolist()
    lo, hi = bootstrap_median_ci(values, resamples=1000, seed=7, q=q)
    stat = float(np.percentile(values, q, method="nearest"))
    assert lo <= stat <= hi
    assert lo < hi
    if q == 50.0:
        assert lo <= statistics.median(values) <= hi
    assert bootstrap_median_ci(values, resamples=1000, seed=7, q=q) == (lo, hi)
    # more data, a narrower interval of the median
    if q == 50.0 and n == 200:
        lo20, hi20 = bootstrap_median_ci(values[:20], resamples=1000, seed=7, q=q)
        assert hi - lo < hi20 - lo20


def test_report_writes_markdown_and_small_pngs(tmp_path, capsys):
    extra = "kvo-eager+load_mode=layered"
    paths = []
    for i in range(2):
        order = ["kvo-lazy", "none", extra, "simple", "kvo-eager", "offloading"]
        order = order[i:] + order[:i]
        rows = [
            row(c, w, r, order=j, seed=100 * i + j, ttft_ms=50.0 * r)
            for w, rates in (("random", [2.0]), ("prefix", [2.0, 8.0, 32.0]))
            for r in rates
            for j, c in enumerate(order)
        ]
        rows += [row(c, "chat", 8.0, order=j) for j, c in enumerate(order)]
        paths.append(
            write_call(tmp_path, f"call{i}", rows, date=f"2026-11-2{6 + i}T04:00:00+00:00")
        )
    # a call whose timeout killed it before `simple` recorded its status (its rows stand)
    cut = json.loads(paths[1].read_text())
    del cut["servers"]["simple"]["status"]
    paths[1].write_text(json.dumps(cut))
    md, plots = tmp_path / "out" / "report.md", tmp_path / "plots"
    args = ["--md", str(md), "--plots", str(plots)]
    assert sr.main([*map(str, paths), *args]) == 0
    text = md.read_text()
    for label in ("random@2", "prefix@2", "prefix@8", "prefix@32", "chat@8"):
        assert f"## {label}\n" in text
    # known configurations first, in their order, then the others
    table = text.split("## prefix@8\n")[1].split("Verdict")[0]
    found = [c for c in ("none", "offloading", "simple", "kvo-eager", "kvo-lazy", extra)
             if f"| {c} | 2 |" in table]  # fmt: skip
    assert found == ["none", "offloading", "simple", "kvo-eager", "kvo-lazy", extra]
    positions = [table.index(f"| {c} | 2 |") for c in found]
    assert positions == sorted(positions)
    assert f"| {extra} | **" in text  # a kvo variant gets verdicts too
    assert "python -m bench serve sweep --configs kvo-lazy,none," in text
    assert "2026-11-26 04:00 – 2026-11-27 04:00 UTC" in text
    assert "| simple: cut: no status (the call ended first) |" in text
    assert f"- {extra}: of 15 (point, metric) comparisons: " in text
    pngs = sorted(plots.glob("*.png"))
    assert [p.name for p in pngs] == [
        "serve_prefix_host_hit.png",
        "serve_prefix_throughput.png",
        "serve_prefix_tpot.png",
        "serve_prefix_ttft.png",
    ]
    for p in pngs:
        data = p.read_bytes()
        assert data[:8] == PNG_MAGIC and 1000 < len(data) < 150_000
        assert f"](../plots/{p.name})" in text
    assert "## Summary" in capsys.readouterr().out


def test_unreadable_input_fails_with_a_clear_message(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"benchmark": "other"}')
    with pytest.raises(SystemExit, match="no `rows` list"):
        sr.build([bad])


def test_committed_h100_calls(tmp_path):
    files = sorted(RESULTS.glob("*.json.xz"))
    a1, a2, b1 = (RESULTS / f"{n}.json.xz" for n in ("a1", "a2", "b1"))
    assert {a1, a2, b1} <= set(files)
    rep = sr.build([a1, a2, b1])
    # prefix@32 ran in a1 and a2 for the vLLM connectors, in a2 only for kvo
    vals = [
        r["request_throughput"]
        for p in (a1, a2)
        for r in read_result(p)["rows"]
        if (r["point"], r["config"]) == ("prefix@32", "offloading")
    ]
    off = rep.points["prefix@32"]["offloading"].stats["request_throughput"]
    assert off == sr.Stat(statistics.median(vals), min(vals), max(vals), 2)
    assert rep.points["prefix@32"]["kvo-eager"].calls == ["a2"]
    assert rep.points["prefix@32"]["none"].calls == ["a1"]
    assert list(rep.points) == [
        "random@2", "prefix@2", "prefix@4", "prefix@8", "prefix@16", "prefix@32", "chat@8"
    ]  # fmt: skip
    # every kvo configuration at every point with a rival has its three verdicts
    for label, point in rep.points.items():
        for config in (c for c in point if c.startswith("kvo")):
            got = {v.metric for v in rep.verdicts if (v.point, v.config) == (label, config)}
            assert got == set(sr.VERDICT_METRICS), (label, config)

    # the command over every committed file (later calls included): each point, each failure
    md = tmp_path / "serve.md"
    assert sr.main([*map(str, files), "--md", str(md), "--plots", str(tmp_path / "p")]) == 0
    text = md.read_text()
    assert "NVIDIA H100 80GB HBM3" in text
    for p in files:
        data, stem = read_result(p), result_stem(p)
        assert f"# {stem}\npython -m bench serve sweep --model" in text
        for r in data["rows"]:
            if sr.usable(r):
                assert f"## {r['point']}\n" in text
            else:
                assert f"{stem}: {r['config']} {r['point']} rc {r['rc']}" in text
    for png in (tmp_path / "p").glob("*.png"):
        assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size < 150_000
