"""Paired light-load A/B of `vllm serve` configurations: the 0%-hit cost of offloading, with
the machine's own drift taken out.

Every configuration's server (serve_sweep's `Server`, each kvoffload one with its own sidecar)
runs at once on the one GPU, each with its share of GPU memory and the same GPU KV cache. The
client sends one request at a time, never two at once: a round sends one fresh random prompt
(0% hits on either tier) to each server, in an order that rotates every round, then the next
round. Why: on a shared GPU VM the host's speed drifts by 10-20% over minutes, which is
larger than the 1% being judged. Rounds seconds apart see the same machine, so each round's
TTFT ratio to the baseline is a fair pair; the report gives the median ratio with a bootstrap
95% interval.

    python -m bench serve_paired --configs none,kvo-eager --rounds 300 --out X.json
    (any serve_sweep engine flag works; --gpu-mem-util is split between the servers)
    python -m bench serve_paired merge bench/out/serve_paired/*.json* --pair kvo-eager/none
    python -m bench serve_paired modes bench/out/serve_paired/call1.json.xz

A server's small offset for the whole call follows its start order, so a call can
start two servers of each configuration A B B A (`--configs none,kvo-eager,kvo-eager#2,none#2`):
the pooled ratio (geometric mean of each configuration's servers, round by round) is then
balanced for the start order within the call, and `none#2` against `none` measures the offset.

`--warmup-burst N` first sends N fresh prompts to every server at once, `--warmup-concurrency`
at a time per server, and reports none of them. It is what brings kvoffload's default
`store_threshold: auto` to its 0%-hit state (the gate closes after 64 requests that repeat
nothing) in ~10 s instead of 64 paired rounds (~80 s of a call's measuring time).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    bootstrap_median_ci,
    machine,
    percentile,
    read_result,
    result_stem,
    rotations,
    table,
)
from serve_model import build_model_dir  # noqa: E402
from serve_sweep import SERVED_NAME, Server, build_parser, config_of  # noqa: E402


def random_prompt(rng: random.Random, tokens: int, vocab: int) -> list[int]:
    """Token ids that no other prompt of the run shares a block with (random from the first)."""
    return [rng.randrange(16, vocab - 16) for _ in range(tokens)]


def timed_request(url: str, prompt: list[int], max_tokens: int, timeout_s: float) -> dict:
    """One streamed completion: seconds to the first token and to the last, tokens seen."""
    body = json.dumps(
        {
            "model": SERVED_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
        }
    ).encode()
    req = urllib.request.Request(
        f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    first = None
    chunks = 0
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - t0
            chunks += 1
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return {"ttft_s": first, "e2e_s": time.perf_counter() - t0, "chunks": chunks}


def warmup_burst(
    servers: list[Server], rng: random.Random, a: argparse.Namespace, vocab: int
) -> dict[str, dict[str, float]]:
    """`a.warmup_burst` fresh prompts to every server at once, `a.warmup_concurrency` in flight
    per server; per server label: requests answered and seconds. A request that fails fails
    the call (a server that cannot serve its warm-up cannot be measured)."""
    if a.warmup_burst < 1:
        return {}
    work = [
        (s, random_prompt(rng, a.prompt_tokens, vocab))
        for s in servers
        for _ in range(a.warmup_burst)
    ]

    def send(job: tuple[Server, list[int]]) -> str:
        server, prompt = job
        timed_request(server.url, prompt, a.output_tokens, a.request_timeout_s)  # raises
        return server.config

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=a.warmup_concurrency * len(servers)) as pool:
        answered = list(pool.map(send, work))
    seconds = round(time.monotonic() - t0, 1)
    return {s.config: {"requests": answered.count(s.config), "seconds": seconds} for s in servers}


def paired_summary(ttft: dict[str, list[float]], baseline: str) -> list[dict[str, Any]]:
    """Per configuration: TTFT p50/p90 (ms) and, against `baseline`, the median of the
    per-round ratios with its bootstrap 95% interval (round i of every configuration is a pair)."""
    rows = []
    for config, xs in ttft.items():
        row: dict[str, Any] = {
            "config": config,
            "n": len(xs),
            "ttft_p50_ms": round(statistics.median(xs) * 1e3, 2),
            "ttft_p90_ms": round(percentile(xs, 90) * 1e3, 2),
        }
        if config != baseline:
            ratios = [a / b for a, b in zip(xs, ttft[baseline], strict=True)]
            lo, hi = bootstrap_median_ci(ratios)
            row.update(
                ratio_p50=round(statistics.median(ratios), 4),
                ratio_ci95=[round(lo, 4), round(hi, 4)],
                faster_rounds=sum(r < 1 for r in ratios),
            )
        rows.append(row)
    return rows


def paired_between(ttft: dict[str, list[float]], baseline: str) -> list[dict[str, Any]]:
    """Every pair of the non-baseline configurations, later against earlier (a change against
    the setting it replaces, e.g. `kvo-eager` and `kvo-eager+store_after_first_token=false`):
    the same per-round ratios, so two variants are compared without the baseline's noise."""
    others = [c for c in ttft if c != baseline]
    rows = []
    for i, first in enumerate(others):
        for second in others[i + 1 :]:
            ratios = [a / b for a, b in zip(ttft[first], ttft[second], strict=True)]
            rows.append(ratio_row(first, second, ratios))
    return rows


def ratio_row(config: str, against: str, ratios: list[float]) -> dict[str, Any]:
    """One pair's per-round ratios: their median, its bootstrap 95% interval, rounds faster."""
    lo, hi = bootstrap_median_ci(ratios)
    return {
        "config": config,
        "against": against,
        "n": len(ratios),
        "ratio_p50": round(statistics.median(ratios), 4),
        "ratio_ci95": [round(lo, 4), round(hi, 4)],
        "faster_rounds": sum(r < 1 for r in ratios),
    }


def servers_of(labels: Any, config: str) -> list[str]:
    """The server labels that run `config`: itself and its replicas (`none`, `none#2`); a
    label with its own `#N` names just that server."""
    return [x for x in labels if x == config or ("#" not in config and config_of(x) == config)]


def pooled_ttft(samples: dict[str, list[dict]], labels: list[str]) -> dict[int, float]:
    """Round -> geometric mean TTFT of `labels`' servers, for the rounds all of them answered."""
    per_label = [{x["round"]: x["ttft_s"] for x in samples[label]} for label in labels]
    rounds = set.intersection(*(set(d) for d in per_label)) if per_label else set()
    return {
        r: math.exp(statistics.fmean(math.log(d[r]) for d in per_label)) for r in sorted(rounds)
    }


def pooled_summary(ttft: dict[str, list[float]], baseline: str) -> list[dict[str, Any]]:
    """Where a configuration ran on more than one server: each configuration's servers pooled
    (geometric mean per round) against the baseline's, and each replica against the first
    server of its configuration (the size of a server's own offset in this call)."""
    groups: dict[str, list[str]] = {}
    for label in ttft:
        groups.setdefault(config_of(label), []).append(label)
    if all(len(g) == 1 for g in groups.values()):
        return []
    base = groups[config_of(baseline)]

    def pooled(labels: list[str]) -> list[float]:
        return [
            math.exp(statistics.fmean(math.log(ttft[x][i]) for x in labels))
            for i in range(len(ttft[labels[0]]))
        ]

    rows = []
    for config, labels in groups.items():
        if labels is not base:
            ratios = [a / b for a, b in zip(pooled(labels), pooled(base), strict=True)]
            rows.append(
                ratio_row(
                    f"{config} (x{len(labels)})", f"{config_of(baseline)} (x{len(base)})", ratios
                )
            )
    for labels in groups.values():
        for label in labels[1:]:
            ratios = [a / b for a, b in zip(ttft[label], ttft[labels[0]], strict=True)]
            rows.append(ratio_row(label, labels[0], ratios))
    return rows


def call_ratio(report: dict[str, Any], config: str, against: str) -> float | None:
    """One call's median per-round TTFT ratio `config`/`against` (rounds both answered; a
    configuration on several servers pooled per round), or None when the call ran only one."""
    samples = report.get("samples", {})
    mine = servers_of(samples, config)
    theirs = [x for x in servers_of(samples, against) if x not in mine]  # none#2 / none
    if not mine or not theirs:
        return None
    ours, base = pooled_ttft(samples, mine), pooled_ttft(samples, theirs)
    ratios = [t / base[r] for r, t in ours.items() if r in base]
    return statistics.median(ratios) if ratios else None


def across_calls(reports: dict[str, dict[str, Any]], config: str, against: str) -> dict[str, Any]:
    """`config`/`against` over several calls. Each call starts its own servers, and a server
    keeps its small offset (placement, the machine it landed on) for the whole call, so one
    call's bootstrap interval, from its rounds, is narrower than the spread between calls: the
    verdict takes each call's median as one sample and gives their median and range.

    The offset also follows the start order (the server started first has read ~0.7% slower
    than its call's mean), so the row says which of the pair started
    first in each call, and gives the geometric mean with its standard error: over calls that
    cover every start order equally, the start order cancels out of the mean. Calls rarely
    do, so `by_order` gives the geometric mean of the calls where each of the pair started
    first, and `order_balanced` the geometric mean of those two: each order weighs the same
    however many calls it had. A call that started A B B A is balanced within itself
    (`balanced`): it weighs as both orders at once (None until the estimate is balanced)."""
    per_call = {name: r for name, rep in reports.items() if (r := call_ratio(rep, config, against))}
    medians = sorted(per_call.values())
    logs = [math.log(v) for v in medians]
    first_of = {name: started_first(reports[name], config, against) for name in per_call}
    first = list(first_of.values())
    strata = (config, against, BALANCED) if BALANCED in first else (config, against)
    by_order = {
        c: _geo_mean([v for name, v in per_call.items() if first_of[name] == c]) for c in strata
    }
    return {
        "config": config,
        "against": against,
        "calls": len(medians),
        "per_call": {k: round(v, 4) for k, v in per_call.items()},
        "median": round(statistics.median(medians), 4) if medians else None,
        "range": [round(medians[0], 4), round(medians[-1], 4)] if medians else None,
        "geo_mean": round(math.exp(statistics.fmean(logs)), 4) if logs else None,
        "sem": round(statistics.stdev(logs) / math.sqrt(len(logs)), 4) if len(logs) > 1 else None,
        "first_started": {c: first.count(c) for c in strata},
        "by_order": {(c if c == BALANCED else f"{c} first"): v for c, v in by_order.items()},
        "order_balanced": _order_balanced(by_order, config, against),
    }


def modes_across_calls(
    reports: dict[str, dict[str, Any]], config: str, against: str
) -> dict[str, Any]:
    """`config` against `against` split by the GPU VM's two TTFT modes (`mode_split`, each
    call cut on its own): per call, each side's slow share (mean over its servers) and the
    ratio of their fast-mode medians; over calls, the mean slow-share difference with its
    standard error and the geometric mean of the fast-mode ratios. Why: a call's median ratio
    mixes what a configuration costs within a mode with how often its requests fell in the
    slow one, and the two have different causes."""
    per_call: dict[str, dict[str, Any]] = {}
    for name, rep in reports.items():
        samples = rep.get("samples", {})
        mine = servers_of(samples, config)
        theirs = [x for x in servers_of(samples, against) if x not in mine]
        if not mine or not theirs:
            continue
        rows = {r["config"]: r for r in mode_split(samples)["rows"]}
        fast = [[rows[x]["fast_p50_ms"] for x in side] for side in (mine, theirs)]
        if any(v is None for side in fast for v in side):
            continue  # a server with no fast request: no fast-mode median to compare
        per_call[name] = {
            "slow_share": [
                round(statistics.fmean(rows[x]["slow_share"] for x in side), 3)
                for side in (mine, theirs)
            ],
            "fast_ratio": round(statistics.fmean(fast[0]) / statistics.fmean(fast[1]), 4),
        }
    diffs = [c["slow_share"][0] - c["slow_share"][1] for c in per_call.values()]
    ratios = [c["fast_ratio"] for c in per_call.values()]
    return {
        "calls": len(per_call),
        "per_call": per_call,
        "slow_share_diff": round(statistics.fmean(diffs), 3) if diffs else None,
        "slow_share_diff_sem": round(statistics.stdev(diffs) / math.sqrt(len(diffs)), 3)
        if len(diffs) > 1
        else None,
        "fast_ratio_geo_mean": _geo_mean(ratios),
    }


BALANCED = "balanced"  # a call whose servers of the pair started in a balanced order (A B B A)


def _order_balanced(by_order: dict[str, float | None], config: str, against: str) -> float | None:
    """Each start order the same weight: the two one-sided strata, and the balanced calls'
    stratum counted as both; None while one order has no call and no balanced call exists."""
    one_sided = [by_order[config], by_order[against]]
    balanced = by_order.get(BALANCED)
    if None in one_sided:
        return balanced
    return _geo_mean(one_sided + ([balanced, balanced] if balanced is not None else []))


def _geo_mean(values: list[float]) -> float | None:
    return round(math.exp(statistics.fmean(map(math.log, values))), 4) if values else None


def started_first(report: dict[str, Any], config: str, against: str) -> str | None:
    """Which of the pair the call started first (serve_paired starts servers in --configs
    order): the one whose servers' mean start position is earlier, `BALANCED` when equal (A B
    B A), None when the report does not say."""
    order = report.get("args", {}).get("configs") or []
    mine = [i for i, x in enumerate(order) if x in servers_of(order, config)]
    theirs = [i for i, x in enumerate(order) if x in servers_of(order, against) and i not in mine]
    if not mine or not theirs:
        return None
    a, b = statistics.fmean(mine), statistics.fmean(theirs)
    return BALANCED if a == b else config if a < b else against


def call_names(files: list[Path]) -> dict[str, Path]:
    """One name per call: the file's stem, or its folder and stem where stems repeat (each
    device call writes `$OUT/pN/sweep.json`); a file given twice is refused."""
    if len(set(map(Path.resolve, files))) != len(files):
        raise SystemExit("serve_paired.py merge: a file is given twice")
    stems = [result_stem(f) for f in files]
    if len(set(stems)) == len(stems):
        return dict(zip(stems, files, strict=True))
    return {f"{f.parent.name}/{s}": f for f, s in zip(files, stems, strict=True)}


def mode_split(samples: dict[str, list[dict]]) -> dict[str, Any]:
    """TTFT on the GPU VM comes in two modes ~9 ms apart, shared by the servers of a round and
    lasting several rounds: a median ratio then moves with each server's share of
    slow-mode requests as much as with its time in either mode. The cut is the midpoint of the
    pooled 20th and 80th percentiles; per server: its slow share and each mode's median; per
    round: how many servers were slow, beside the counts expected if each were slow on its own
    (binomial at the pooled share)."""
    n = min(len(v) for v in samples.values())
    cut = statistics.fmean(
        percentile([x["ttft_s"] for v in samples.values() for x in v[:n]], q) for q in (20, 80)
    )
    rows = []
    for label, v in samples.items():
        ttft = [x["ttft_s"] for x in v[:n]]
        fast = [t for t in ttft if t <= cut]
        slow = [t for t in ttft if t > cut]
        rows.append(
            {
                "config": label,
                "n": n,
                "slow_share": round(len(slow) / n, 3),
                "fast_p50_ms": round(1e3 * statistics.median(fast), 2) if fast else None,
                "slow_p50_ms": round(1e3 * statistics.median(slow), 2) if slow else None,
            }
        )
    k = len(samples)
    share = sum(r["slow_share"] for r in rows) / k
    counts = [sum(v[i]["ttft_s"] > cut for v in samples.values()) for i in range(n)]
    return {
        "cut_ms": round(1e3 * cut, 2),
        "rows": rows,
        "slow_servers_per_round": {j: counts.count(j) for j in range(k + 1)},
        "if_independent": {
            j: round(n * math.comb(k, j) * share**j * (1 - share) ** (k - j), 1)
            for j in range(k + 1)
        },
    }


def modes_main(argv: list[str]) -> int:
    """`serve_paired modes FILES...`: each call's two TTFT modes (`mode_split`)."""
    p = argparse.ArgumentParser(prog="serve_paired.py modes", description=mode_split.__doc__)
    p.add_argument("files", nargs="+", type=Path)
    a = p.parse_args(argv)
    for name, f in call_names(a.files).items():
        samples = read_result(f)["samples"]
        modes = mode_split(samples)
        print(f"\n== {name}: cut at {modes['cut_ms']} ms ==")
        print(table(modes["rows"]))
        print(f"slow servers per round: {modes['slow_servers_per_round']}")
        print(f"if each were slow alone: {modes['if_independent']}")
    return 0


def merge_main(argv: list[str]) -> int:
    """`serve_paired.py merge FILES... --pair kvo-eager/none [--pair ...]`: the across-call
    table of earlier calls' JSON."""
    p = argparse.ArgumentParser(prog="serve_paired.py merge", description=across_calls.__doc__)
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--pair", action="append", required=True, help="CONFIG/AGAINST")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    a = p.parse_args(argv)
    if any(pair.count("/") != 1 for pair in a.pair):
        p.error("--pair: CONFIG/AGAINST, e.g. kvo-eager/none")
    reports = {name: read_result(f) for name, f in call_names(a.files).items()}
    rows = [
        {
            **across_calls(reports, *pair.split("/")),
            "modes": modes_across_calls(reports, *pair.split("/")),
        }
        for pair in a.pair
    ]
    print(
        table(
            [
                {
                    **{k: v for k, v in r.items() if k != "modes"},
                    "per_call": " ".join(f"{k}:{v}" for k, v in r["per_call"].items()),
                    "first_started": " ".join(f"{k}:{v}" for k, v in r["first_started"].items()),
                    "by_order": " ".join(f"{k}:{v}" for k, v in r["by_order"].items()),
                }
                for r in rows
            ]
        )
    )
    print("\n== by mode: slow share (config, against) and fast-mode p50 ratio, per call ==")
    print(
        table(
            [
                {
                    "config": r["config"],
                    "against": r["against"],
                    "calls": r["modes"]["calls"],
                    "per_call": " ".join(
                        f"{k}:{c['slow_share'][0]}/{c['slow_share'][1]},{c['fast_ratio']}"
                        for k, c in r["modes"]["per_call"].items()
                    ),
                    "slow_share_diff": r["modes"]["slow_share_diff"],
                    "sem": r["modes"]["slow_share_diff_sem"],
                    "fast_ratio_geo_mean": r["modes"]["fast_ratio_geo_mean"],
                }
                for r in rows
            ]
        )
    )
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def run(a: argparse.Namespace) -> dict[str, Any]:
    t_start = time.monotonic()
    out = Path(a.out)
    work = out.with_suffix("")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model_dir = build_model_dir(Path(a.model) / "config.json", work / "model")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    if a.gpu_mem_util_total:
        a.gpu_mem_util = round(a.gpu_mem_util_total / len(a.configs), 3)
    servers = [Server(a, c, model_dir, work) for c in a.configs]
    report: dict[str, Any] = {
        "benchmark": "serve_paired",
        "machine": machine(),
        "args": vars(a),
        "servers": {},
    }
    rng = random.Random(a.seed)
    samples: dict[str, list[dict]] = {c: [] for c in a.configs}
    try:
        for s in servers:  # one at a time: each profiles GPU memory with the others settled
            s.start()
            report["servers"][s.config] = {"start_s": round(s.start_s, 1), "argv": s.argv()}
            print(f"   {s.config}: started in {s.start_s:.0f} s", flush=True)
        burst = warmup_burst(servers, rng, a, vocab)
        for label, done in burst.items():
            report["servers"][label]["warmup_burst"] = done
        if burst:
            print(
                f"   warm-up burst: {a.warmup_burst} per server in "
                f"{next(iter(burst.values()))['seconds']:.0f} s",
                flush=True,
            )
        # the slow starts come out of the rounds, not past --budget-s (a caller's timeout)
        t_end = min(time.monotonic() + a.measure_s, t_start + a.budget_s)
        orders = rotations(servers, a.warmup_rounds + a.rounds)
        for i, order in enumerate(orders):
            if time.monotonic() > t_end:
                print(f"   out of time after {i} rounds", flush=True)
                break
            for s in order:
                prompt = random_prompt(rng, a.prompt_tokens, vocab)
                sent = round(time.time(), 3)
                r = timed_request(s.url, prompt, a.output_tokens, a.request_timeout_s)
                if i >= a.warmup_rounds:
                    samples[s.config].append({"round": i, "sent": sent, **r})
                time.sleep(a.gap_s)
        for s in servers:
            report["servers"][s.config]["sidecar_stats"] = s.sidecar_stats()
    finally:
        for s in servers:
            s.stop()
    n = min(len(v) for v in samples.values())  # whole rounds only: every ratio is a pair
    ttft = {c: [x["ttft_s"] for x in v[:n]] for c, v in samples.items()}
    report["rows"] = paired_summary(ttft, a.configs[0]) if n else []
    report["between"] = paired_between(ttft, a.configs[0]) if n else []
    report["pooled"] = pooled_summary(ttft, a.configs[0]) if n else []
    report["samples"] = samples
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"\n== paired light load: {n} rounds, baseline {a.configs[0]} ==")
    print(table(report["rows"]))
    if report["between"]:
        print("\n== the other configurations, paired with each other ==")
        print(table(report["between"]))
    if report["pooled"]:
        print("\n== each configuration's servers pooled, and each replica against its first ==")
        print(table(report["pooled"]))
    return report


def build_paired_parser() -> argparse.ArgumentParser:
    p = build_parser()
    p.description = __doc__.split("\n\n")[0]
    p.set_defaults(out=str(Path(__file__).resolve().parent / "out/serve_paired/paired.json"))
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--warmup-rounds", type=int, default=10)
    p.add_argument(
        "--warmup-burst",
        type=int,
        default=0,
        help="fresh prompts sent to every server at once before the rounds, not reported",
    )
    p.add_argument("--warmup-concurrency", type=int, default=8, help="per server, in the burst")
    p.add_argument("--measure-s", type=float, default=360.0, help="stop rounds after this")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--gap-s", type=float, default=0.1, help="idle time after each request")
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--gpu-mem-util-total",
        type=float,
        default=0.0,
        help="split this share of GPU memory between the servers (else each gets --gpu-mem-util)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["merge"]:
        return merge_main(argv[1:])
    if argv[:1] == ["modes"]:
        return modes_main(argv[1:])
    parser = build_paired_parser()
    a = parser.parse_args(argv)
    if len(a.configs) < 2:
        parser.error("--configs: give a baseline and at least one configuration to pair with it")
    if a.rounds < 1 or a.prompt_tokens < 1 or a.output_tokens < 1:
        parser.error("--rounds, --prompt-tokens and --output-tokens must be >= 1")
    if a.warmup_burst < 0 or a.warmup_concurrency < 1:
        parser.error("--warmup-burst must be >= 0 and --warmup-concurrency >= 1")
    run(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
