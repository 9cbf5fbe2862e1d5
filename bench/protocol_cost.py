"""What the slot protocol costs: a pool hit's TTFT and `vllm serve` under load, the tree at HEAD
against an earlier one (`.old/`), side by side in one GPU call (`bench/protocol_cost_run.sh`).

    python -m bench protocol_cost e2e OUT.json RUN.json...     (e2e_gpu reports, one per engine)
    python -m bench protocol_cost serve OUT.json SWEEP.json... (serve_sweep reports, one per server)

Each RUN.json is one `bench/e2e_gpu.py` report of one engine (`kvo-layer`) whose file name
says its tree (`e2e.new.3.json`, `e2e.old.4.json`). Per tree and prompt size: the pool-hit
samples (a connector hit of the whole prompt but its last chunk, first token equal to the GPU
hit's), median and min-max, and new/old as a ratio of medians with a 95% bootstrap interval
(each tree's samples resampled on their own, seeded). Serve: per tree, each server's
requests/s, TTFT p50 and p99, host hit rate (median and min-max over servers), and new/old of the
TTFT p50 over every request of a tree, with the same interval.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import percentile, spread  # noqa: E402


def ratio_ci(new: list[float], old: list[float], resamples: int = 4000, seed: int = 0):
    """A 95% percentile-bootstrap interval of median(new) / median(old)."""
    if not new or not old:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    rs = sorted(
        statistics.median(rng.choices(new, k=len(new)))
        / statistics.median(rng.choices(old, k=len(old)))
        for _ in range(resamples)
    )
    return percentile(rs, 2.5), percentile(rs, 97.5)


def e2e(out: Path, paths: list[Path]) -> int:
    samples: dict[tuple[str, int], list[float]] = {}
    checks: dict[str, dict[str, int]] = {}
    runs = []
    for p in sorted(paths):
        tree = p.name.split(".")[1]
        r = json.loads(p.read_text())
        for run in r.get("runs", {}).values():
            ttft = run.get("sections", {}).get("ttft", {}).get("samples", {})
            runs.append(
                {
                    "file": p.name,
                    "tree": tree,
                    "status": run.get("status"),
                    "error": run.get("error"),
                    "engine_start_s": run.get("engine", {}).get("start_s"),
                }
            )
            for name, pool in ttft.items():
                size, phase = name.split("/")
                if phase != "pool_hit":
                    continue
                gpu = ttft.get(f"{size}/gpu_hit", [])
                c = checks.setdefault(tree, {"pool_hits": 0, "hit": 0, "same_token": 0})
                for i, s in enumerate(pool):
                    c["pool_hits"] += 1
                    ext = s.get("counters", {}).get(
                        "vllm:prompt_tokens_by_source[external_kv_transfer]", 0.0
                    )
                    hit = ext >= s["prompt_tokens"] - 256  # loaded from the pool, not the GPU
                    same = i < len(gpu) and s["first_token"] == gpu[i]["first_token"]
                    c["hit"] += hit
                    c["same_token"] += same
                    if hit and same:
                        samples.setdefault((tree, int(size)), []).append(s["wall_ms"])
    rows = []
    for size in sorted({k[1] for k in samples}):
        old, new = samples.get(("old", size), []), samples.get(("new", size), [])
        so, sn = spread(old), spread(new)
        lo, hi = ratio_ci(new, old)
        rows.append(
            {
                "prompt": size,
                "old": so,
                "new": sn,
                "ratio": sn["p50"] / so["p50"] if old and new else float("nan"),
                "ratio_ci95": [lo, hi],
                "old_ms": old,
                "new_ms": new,
            }
        )
    lines = [
        "| prompt | old ms p50 (min-max) n | new ms p50 (min-max) n | new/old [95%] |",
        "|---|---|---|---|",
    ]
    for r in rows:
        o, n = r["old"], r["new"]
        lines.append(
            f"| {r['prompt']:,} | {o['p50']:.1f} ({o['min']:.1f}-{o['max']:.1f}) {o['n']} "
            f"| {n['p50']:.1f} ({n['min']:.1f}-{n['max']:.1f}) {n['n']} "
            f"| {r['ratio']:.3f} [{r['ratio_ci95'][0]:.3f}, {r['ratio_ci95'][1]:.3f}] |"
        )
    lines.append(f"checks: {json.dumps(checks)}")
    out.write_text(
        json.dumps(
            {
                "bench": "protocol_cost_e2e",
                "rows": rows,
                "checks": checks,
                "runs": runs,
                "table": lines,
            },
            indent=1,
        )
    )
    print("\n".join(lines))
    return 0


def serve(out: Path, paths: list[Path]) -> int:
    per: dict[str, list[dict[str, Any]]] = {}
    ttfts: dict[str, list[float]] = {}
    for p in sorted(paths):
        tree = p.name.split(".")[1]
        r = json.loads(p.read_text())
        for row in r.get("rows", []):
            if row.get("workload") != "prefix":
                continue
            per.setdefault(tree, []).append(
                {
                    "file": p.name,
                    "point": row["point"],
                    "completed": row["completed"],
                    "failed": row["failed"],
                    "req_s": row["request_throughput"],
                    "ttft_p50_ms": row["median_ttft_ms"],
                    "ttft_p99_ms": row["p99_ttft_ms"],
                    "tpot_p50_ms": row["median_tpot_ms"],
                    "host_hit_rate": row["host_hit_rate"],
                    "preemptions": row.get("preemptions"),
                }
            )
            ttfts.setdefault(tree, []).extend(row.get("ttfts_ms", []))
    summary: dict[str, Any] = {}
    for tree, rows in per.items():
        summary[tree] = {
            k: spread([r[k] for r in rows])
            for k in ("req_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "host_hit_rate")
        }
        summary[tree]["failed"] = sum(r["failed"] for r in rows)
        allt = ttfts.get(tree, [])
        summary[tree]["all_requests"] = {
            "n": len(allt),
            "ttft_p50_ms": spread(allt)["p50"],
            "ttft_p99_ms": percentile(allt, 99),
        }
    new, old = ttfts.get("new", []), ttfts.get("old", [])
    ratio = spread(new)["p50"] / spread(old)["p50"] if new and old else float("nan")
    ci = ratio_ci(new, old)
    lines = [
        "| tree | servers | req/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | host hit | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for tree in ("old", "new"):
        if tree not in summary:
            continue
        m = summary[tree]
        cell = lambda k, d=1, m=m: f"{m[k]['p50']:.{d}f} ({m[k]['min']:.{d}f}-{m[k]['max']:.{d}f})"  # noqa: E731
        lines.append(
            f"| {tree} | {m['req_s']['n']} | {cell('req_s', 2)} | {cell('ttft_p50_ms')} "
            f"| {cell('ttft_p99_ms')} | {cell('tpot_p50_ms', 2)} | {cell('host_hit_rate', 3)} "
            f"| {m['failed']} |"
        )
    lines.append(f"new/old TTFT p50 over all requests: {ratio:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]")
    out.write_text(
        json.dumps(
            {
                "bench": "protocol_cost_serve",
                "servers": per,
                "summary": summary,
                "ttft_p50_ratio": ratio,
                "ttft_p50_ratio_ci95": list(ci),
                "table": lines,
            },
            indent=1,
        )
    )
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[0] not in ("e2e", "serve"):
        print(__doc__)
        return 2
    return (e2e if argv[0] == "e2e" else serve)(Path(argv[1]), [Path(a) for a in argv[2:]])


if __name__ == "__main__":
    sys.exit(main())
