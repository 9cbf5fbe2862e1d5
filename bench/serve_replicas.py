"""`serve replicas`: two `vllm serve` replicas of one model on one machine, a shared-prefix
workload sent to both in turn, on two pool setups one after the other in one call:

- `node`: a real node agent (`kvoffload node-agent` beside `kvoffload node-holder`) with one
  tenant of --pool-gib; a stand-in kubelet publishes each replica's CSI volume
  (bench/node_standin.py) and each replica's connector uses its own pod's `pool.sock`
  (placement node);
- `pod`: each replica its own sidecar pool of half --pool-gib (the same host memory in all).

The workload: --prefixes shared prefixes of --prefix-tokens, each request one of them and a
suffix of its own. Pass `miss`: prefix i to replica i mod 2 (computed: a miss). Pass `cross`:
prefix i to the other replica (the prefix the first replica computed). Then each replica's
prefix cache is reset (`POST /reset_prefix_cache`, vLLM's dev endpoint) and pass `own`: prefix
i to replica i mod 2 again (the replica's own earlier work, now only in its pool). After each
request the call polls the pool's Stats until that request's chunks are committed (a later
request may depend on them), never a fixed pause. Each replica first answers --warmup-requests
unreported prompts of the same length.

Per setup and replica: TTFT of `cross` (the other replica computed the prefix), of `own` (a
hit in the replica's own pool), their ratio, of `miss`; the host-tier hit rate (vLLM's external
prefix-cache hits / queries, in tokens) and the pools' host bytes (used bytes, stored chunks),
counted from after the warm-up. Verdicts: node `cross` within --max-ratio of `own` on each
replica; the prefixes stored once on the node (its stored chunks those of one copy, fewer
host bytes than the two pod pools).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import cell, report, spread, table  # noqa: E402
from serve import (  # noqa: E402
    ROOT,
    Server,
    add_server_flags,
    completion,
    fresh_workdir,
    random_prompt,
    sidecar_stats,
)

GiB = 1 << 30
SETUPS = ("node", "pod")
PHASES = ("miss", "cross", "own")
REPLICAS = ("A", "B")
TENANT = "bench"  # the node pool's one tenant, granted to namespace TENANT
# the pool counters read before and after the measured passes (summed over namespaces)
POOL_KEYS = ("committedSlots", "reservedSlots", "storedBlocks", "hitBlocks", "queriedBlocks",
             "usedBytes", "evictedBlocks", "loadedBlocks")  # fmt: skip


@dataclass(frozen=True)
class Request:
    phase: str  # miss | cross | own
    prefix: int
    replica: int  # 0: A, 1: B


def plan(prefixes: int) -> list[Request]:
    """The requests of one setup, in order: miss (prefix i to replica i mod 2), cross (to the
    other), own (to replica i mod 2 again, after the prefix-cache reset)."""
    out = [Request("miss", i, i % 2) for i in range(prefixes)]
    out += [Request("cross", i, (i + 1) % 2) for i in range(prefixes)]
    return out + [Request("own", i, i % 2) for i in range(prefixes)]


def new_chunks(setup: str, phase: str, prefix: int, suffix: int, chunk: int) -> int:
    """Chunks a request adds to its replica's pool: a miss computes every full chunk; a cross
    request on the node pool and an own-pool hit add only chunks past the prefix (its suffix's);
    a cross request on a pod pool computes everything again (that pool never had the prefix)."""
    whole = (prefix + suffix) // chunk
    if phase == "miss" or (phase == "cross" and setup == "pod"):
        return whole
    return whole - prefix // chunk


def expected_stored(setup: str, prefixes: int, prefix: int, suffix: int, chunk: int) -> int:
    """Chunks the measured passes store in the setup's pools together."""
    return sum(new_chunks(setup, r.phase, prefix, suffix, chunk) for r in plan(prefixes))


def pool_totals(stats: dict[str, Any]) -> dict[str, int]:
    """POOL_KEYS of a Stats answer (protobuf JSON), summed over its namespaces."""
    return {k: sum(int(ns.get(k, 0)) for ns in stats.get("namespaces", [])) for k in POOL_KEYS}


def chunk_tokens(stats: dict[str, Any]) -> int:
    """Tokens per pool slot of the (first) namespace; 0 before an engine registered."""
    for ns in stats.get("namespaces", []):
        spec = ns.get("spec", {})
        return int(spec.get("blockSize", 0)) * int(spec.get("chunkBlocks", 0))
    return 0


def wait_committed(socket: str, at_least: int, timeout_s: float) -> tuple[float, bool]:
    """Poll the pool's Stats until `at_least` slots are committed and none is reserved (the
    stores landed); seconds waited and whether they did."""
    t0 = time.monotonic()
    while True:
        t = pool_totals(sidecar_stats(socket))
        if t["committedSlots"] >= at_least and t["reservedSlots"] == 0:
            return time.monotonic() - t0, True
        if time.monotonic() - t0 > timeout_s:
            return time.monotonic() - t0, False
        time.sleep(0.02)


def reset_prefix_cache(url: str, timeout_s: float = 30.0) -> int:
    """`POST /reset_prefix_cache` (the GPU prefix cache only) until vLLM says it succeeded
    (it refuses while blocks are held); the attempts it took."""
    t0 = time.monotonic()
    for attempt in range(1, 10_000):
        req = urllib.request.Request(f"{url}/reset_prefix_cache", b"", method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            if json.loads(r.read() or b"{}").get("success", r.status == 200):
                return attempt
        if time.monotonic() - t0 > timeout_s:
            break
        time.sleep(0.05)
    raise RuntimeError(f"{url}: the prefix cache was not reset in {timeout_s} s")


class Setup:
    """The pools and replicas of one setup: `start` brings them up, `stop` ends whatever
    started."""

    def __init__(self, a: argparse.Namespace, name: str, model_dir: Path, work: Path):
        self.a, self.name, self.model_dir, self.work = a, name, model_dir, work  # logs together
        self.root: Path | None = None
        self.holder: Any = None
        self.agent: Any = None
        self.kubelet: Any = None
        self.servers: list[Server] = []
        self.pool_sockets: list[str] = []

    def start(self) -> None:
        a, env, base = self.a, {"VLLM_SERVER_DEV_MODE": "1"}, self.a.connector  # the reset
        if self.name == "node":
            sockets = self._start_node()
            labels = [f"{base}+placement=node", f"{base}+placement=node#2"]
            self.pool_sockets = sockets[:1]  # one pool: either pod's pool.sock serves it
        else:
            half = f"{base}+pool_gib={a.pool_gib / 2:g}"  # each replica's own sidecar
            labels, sockets = [half, f"{half}#2"], ["", ""]
        for label, sock in zip(labels, sockets, strict=True):
            # one at a time: each profiles GPU memory with the others settled
            s = Server(a, label, self.model_dir, self.work, pool_socket=sock, env=env)
            self.servers.append(s)
            s.start()
            print(f"   {self.name} {s.config}: started in {s.start_s:.0f} s", flush=True)
        if not self.pool_sockets:
            self.pool_sockets = [s.sidecar.socket for s in self.servers]

    def _start_node(self) -> list[str]:
        from node_standin import Agent, Kubelet, make_root, new_pod, start_holder

        self.root = make_root()
        self.holder, holder_socket = start_holder(self.root, timeout_s=self.a.start_timeout_s)
        share = int(self.a.pool_gib * GiB)
        tenants = [{"name": TENANT, "shareBytes": share, "namespaces": [TENANT]}]
        pool = {"name": "bench-pool", "tenants": tenants}
        self.agent = Agent(self.root, "--holder-socket", holder_socket, pool=pool)
        self.agent.log = self.work / "node-agent.log"
        self.agent.start(timeout_s=self.a.start_timeout_s)
        self.kubelet = Kubelet(self.root, self.agent.csi_socket)
        sockets = []
        for replica in REPLICAS:
            pod = new_pod(TENANT, f"vllm-{replica.lower()}", TENANT)
            self.kubelet.publish(pod)
            sockets.append(f"{self.kubelet.short(pod)}/pool.sock")
        return sockets

    def pool_of(self, replica: int) -> str:
        return self.pool_sockets[0 if len(self.pool_sockets) == 1 else replica]

    def stop(self) -> None:
        for s in self.servers:
            s.stop()
        if self.kubelet is not None:
            self.kubelet.channel.close()
        if self.agent is not None:
            self.agent.stop()
        if self.holder is not None and self.holder.poll() is None:
            self.holder.terminate()
            self.holder.wait(15)
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)


def registered_chunk(setup: Setup, timeout_s: float) -> int:
    """Tokens per chunk once every pool names its namespace (the engines registered)."""
    deadline = time.monotonic() + timeout_s
    while True:
        chunks = {chunk_tokens(sidecar_stats(s)) for s in setup.pool_sockets}
        if 0 not in chunks:
            if len(chunks) != 1:
                raise RuntimeError(f"{setup.name}: pools of different chunk sizes {chunks}")
            return chunks.pop()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{setup.name}: no engine registered with the pool")
        time.sleep(0.1)


def run_setup(
    a: argparse.Namespace, setup: Setup, prefixes: list[list[int]], vocab: int, seed: int
) -> dict[str, Any]:
    """Warm-up, the three passes, the pools' counters; the setup's samples and totals."""
    rng = random.Random(seed)
    setup.start()
    chunk = registered_chunk(setup, a.start_timeout_s)
    length = a.prefix_tokens + a.suffix_tokens

    def send(replica: int, prompt: list[int], adds: int) -> dict[str, Any]:
        pool = setup.pool_of(replica)
        base = pool_totals(sidecar_stats(pool))["committedSlots"]
        r = completion(setup.servers[replica].url, prompt, a.output_tokens, a.request_timeout_s)
        r["store_wait_s"], r["stored"] = wait_committed(pool, base + adds, a.store_wait_s)
        return r

    for replica in range(len(REPLICAS)):  # unreported; their stores prove the path is live
        for _ in range(a.warmup_requests):
            w = send(replica, random_prompt(rng, length, vocab), length // chunk)
            if not w["stored"]:
                raise RuntimeError(f"{setup.name}: a warm-up request's chunks never committed")
    before = [pool_totals(sidecar_stats(s)) for s in setup.pool_sockets]
    counters_before = [s.counters() for s in setup.servers]
    samples = []
    for req in plan(a.prefixes):
        if req.phase == "own" and samples[-1]["phase"] != "own":
            resets = [reset_prefix_cache(s.url) for s in setup.servers]
            print(f"   {setup.name}: prefix caches reset ({resets} attempts)", flush=True)
        prompt = prefixes[req.prefix] + random_prompt(rng, a.suffix_tokens, vocab)
        adds = new_chunks(setup.name, req.phase, a.prefix_tokens, a.suffix_tokens, chunk)
        r = send(req.replica, prompt, adds)
        samples.append({**asdict(req), "replica": REPLICAS[req.replica], **r})
    after = [pool_totals(sidecar_stats(s)) for s in setup.pool_sockets]
    delta = {k: sum(x[k] - y[k] for x, y in zip(after, before, strict=True)) for k in POOL_KEYS}
    vllm = []
    for s, c0 in zip(setup.servers, counters_before, strict=True):
        c1 = s.counters()
        vllm.append({k: c1[k] - c0[k] for k in c1})
    return {
        "chunk_tokens": chunk,
        "samples": samples,
        "pools": {"before": before, "after": after, "delta": delta},
        "pool_stats": [sidecar_stats(s) for s in setup.pool_sockets],
        "vllm_counters": dict(zip(REPLICAS, vllm, strict=True)),
        "expected_stored_chunks": expected_stored(
            setup.name, a.prefixes, a.prefix_tokens, a.suffix_tokens, chunk
        ),
        "servers": {
            s.config: {"start_s": round(s.start_s, 1), "argv": s.argv()} for s in setup.servers
        },  # fmt: skip
    }


def _p50_ms(samples: list[dict], phase: str, replica: str | None = None) -> list[float]:
    return [
        1e3 * s["ttft_s"]
        for s in samples
        if s["phase"] == phase and (replica is None or s["replica"] == replica)
    ]


def summarize(a: argparse.Namespace, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The table's rows (per setup: both replicas, then each), the verdicts."""
    rows, by_replica = [], []
    for name, res in results.items():
        if "samples" not in res:
            continue
        samples, delta = res["samples"], res["pools"]["delta"]
        cross, own = _p50_ms(samples, "cross"), _p50_ms(samples, "own")
        ratio = statistics.median(cross) / statistics.median(own) if cross and own else None
        # vLLM's counters, not the pool's lookups: a sidecar's presence map answers misses
        # without asking the pool, the node pool offers none
        vc = res["vllm_counters"].values()
        queried = sum(c["vllm:external_prefix_cache_queries"] for c in vc)
        hits = sum(c["vllm:external_prefix_cache_hits"] for c in vc)
        rows.append(
            {
                "setup": name,
                "cross_ttft_p50_ms": cell(cross, 1),
                "own_hit_ttft_p50_ms": cell(own, 1),
                "ratio": round(ratio, 3) if ratio else None,
                "miss_ttft_p50_ms": cell(_p50_ms(samples, "miss"), 1),
                "hit_rate": round(hits / queried, 3) if queried else None,
                "host_bytes_stored": delta["usedBytes"],
                "stored_chunks": delta["storedBlocks"],
                "expected_chunks": res["expected_stored_chunks"],
                "evicted": delta["evictedBlocks"],
            }
        )
        for replica in REPLICAS:
            c, o = (statistics.median(v) if (v := _p50_ms(samples, p, replica)) else None
                    for p in ("cross", "own"))  # fmt: skip
            vc = res["vllm_counters"][replica]
            queries = vc["vllm:external_prefix_cache_queries"]
            by_replica.append(
                {
                    "setup": name,
                    "replica": replica,
                    "cross_ttft_p50_ms": round(c, 2) if c else None,
                    "own_hit_ttft_p50_ms": round(o, 2) if o else None,
                    "ratio": round(c / o, 3) if c and o else None,
                    "miss_ttft_p50_ms": cell(_p50_ms(samples, "miss", replica), 1),
                    "cross_cached_tokens": [
                        s["cached_tokens"]
                        for s in samples
                        if s["phase"] == "cross" and s["replica"] == replica
                    ],
                    "vllm_external_hit_rate": round(
                        vc["vllm:external_prefix_cache_hits"] / queries, 3
                    )
                    if queries
                    else None,
                }  # fmt: skip
            )
    verdicts: dict[str, Any] = {}
    node = next((r for r in rows if r["setup"] == "node"), None)
    pod = next((r for r in rows if r["setup"] == "pod"), None)
    if node:
        ratios = [r["ratio"] for r in by_replica if r["setup"] == "node"]
        ok = all(x is not None and x <= a.max_ratio for x in ratios)
        verdicts[f"cross TTFT within {a.max_ratio}x of own-pool hit"] = {
            "pass": ok, "ratios": dict(zip(REPLICAS, ratios, strict=True))}  # fmt: skip
        once = node["stored_chunks"] == node["expected_chunks"]
        fewer = pod is None or node["host_bytes_stored"] < pod["host_bytes_stored"]
        verdicts["stored once"] = {
            "pass": once and fewer,
            "node_stored_chunks": node["stored_chunks"],
            "one_copy_chunks": node["expected_chunks"],
            "node_host_bytes": node["host_bytes_stored"],
            "pod_host_bytes": pod["host_bytes_stored"] if pod else None,
        }
    return {"rows": rows, "by_replica": by_replica, "verdicts": verdicts}


def build_replicas_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="serve replicas", description=__doc__.split("\n\n")[0])
    add_server_flags(p)
    p.set_defaults(out=str(ROOT / "bench/out/serve_replicas/replicas.json"), gpu_mem_util=0.45)
    add = p.add_argument
    add("--setups", default="node,pod", help="which setups, in this order: node, pod")
    add("--connector", default="kvo-eager", help="the kvo configuration both setups run")
    add("--pool-gib", type=float, default=16.0, help="the node tenant; each pod pool half")
    add("--prefixes", type=int, default=8)
    add("--prefix-tokens", type=int, default=4096)
    add("--suffix-tokens", type=int, default=64)
    add("--output-tokens", type=int, default=4)
    add("--warmup-requests", type=int, default=2, help="per replica, unreported")
    add("--request-timeout-s", type=float, default=120.0)
    add("--store-wait-s", type=float, default=60.0, help="at most, for a request's stores")
    add("--max-ratio", type=float, default=1.1, help="the cross/own verdict's bound")
    add("--seed", type=int, default=0)
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    parser = build_replicas_parser()
    a = parser.parse_args(argv)
    setups = [s.strip() for s in a.setups.split(",") if s.strip()]
    if not setups or any(s not in SETUPS for s in setups) or len(set(setups)) != len(setups):
        parser.error(f"--setups: each of {', '.join(SETUPS)} at most once")
    a.setups = setups
    if "--enable-prompt-tokens-details" not in a.serve_arg:  # cached tokens per request
        a.serve_arg.append("--enable-prompt-tokens-details")
    if not a.connector.startswith("kvo") or "#" in a.connector:
        parser.error("--connector: a kvo configuration (kvo-eager, kvo-lazy, +key=value)")
    if a.prefixes < 2 or a.prefix_tokens < 1 or a.suffix_tokens < 1 or a.output_tokens < 1:
        parser.error("--prefixes must be >= 2; --prefix-tokens, --suffix-tokens, "
                     "--output-tokens >= 1")  # fmt: skip
    if a.prefix_tokens + a.suffix_tokens + a.output_tokens > a.max_model_len:
        parser.error(f"--max-model-len {a.max_model_len} is below a request's tokens")
    if not a.pool_gib > 0:
        parser.error("--pool-gib must be > 0")
    return a


def main(argv: list[str]) -> int:
    a = parse(argv)
    t_end = time.monotonic() + a.budget_s
    out, work, model_dir = fresh_workdir(a)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(a.seed)  # the same prefixes in every setup
    prefixes = [random_prompt(rng, a.prefix_tokens, vocab) for _ in range(a.prefixes)]
    results: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(a.setups):
        left = t_end - time.monotonic()
        if left < a.start_timeout_s / 2:
            results[name] = {"status": f"skipped: {left:.0f} s left"}
            continue
        print(f"== {name}: {left:.0f} s left", flush=True)
        results[name] = {"status": "cut: the call ended before this setup did"}
        setup = Setup(a, name, model_dir, work)
        try:
            # warm-ups and suffixes from a stream of their own: Random(a.seed) made the prefixes
            seed = a.seed + 1 + i
            results[name] = {"status": "ok", **run_setup(a, setup, prefixes, vocab, seed)}
        except KeyboardInterrupt:  # the caller's timeout (gpu_run.sh): report what there is
            break
        except Exception as e:  # noqa: BLE001 - one setup failing is a result
            results[name] = {"status": f"failed: {type(e).__name__}: {e}"[:2000]}
            print(f"   {results[name]['status'][:400]}", flush=True)
        finally:
            setup.stop()
    summary = summarize(a, results)
    spreads = {
        name: {p: spread(_p50_ms(res.get("samples", []), p)) for p in PHASES}
        for name, res in results.items()
    }
    extra = {
        "args": vars(a),
        "setups": results,
        "by_replica": summary["by_replica"],
        "verdicts": summary["verdicts"],
        "ttft_spreads_ms": spreads,
    }
    report("serve_replicas", summary["rows"], out, extra=extra)
    print("\n" + "\n".join(f"{k}: {'PASS' if v['pass'] else 'FAIL'} {v}"
                           for k, v in summary["verdicts"].items()))  # fmt: skip
    print(table(summary["by_replica"]))
    return 0 if all(r.get("status") == "ok" for r in results.values()) else 1
