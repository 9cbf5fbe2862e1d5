"""End to end on the GPU: a real vLLM engine with kvoffload, beside vLLM's own offloading.

One engine per (model, configuration), each in its own child process (clean GPU and host memory,
a crash costs one configuration), all against one real `kvoffload sidecar`. Configurations:

    none        no KV connector (recompute whatever left the GPU prefix cache)
    offloading  vLLM's OffloadingConnector, `cpu_bytes_to_use` = --cpu-gib
    simple      vLLM's SimpleCPUOffloadConnector, same capacity
    kvo-eager   kvoffload, every full chunk stored as soon as it is computed, hits loaded before
                the request runs (load_mode=async)
    kvo-lazy    kvoffload, chunks stored only when their GPU blocks are about to be evicted
                (load_mode=async)
    kvo-layer   kvoffload as shipped: eager stores, hits loaded layer by layer in the step that
                uses them (load_mode=layered, the default)

Sections (each child runs the ones asked for, in this order, within its deadline):

    ttft       one request at a time, max_tokens=1; TTFT = wall time of `LLM.generate` (also
               vLLM's own per-request timestamps). For each size: R distinct prompts, each run
               cold (a miss) and straight again (GPU prefix hit); then filler prompts push every
               prompt out of the small GPU cache (`num_gpu_blocks_override`; no
               `reset_prefix_cache`), and each prompt runs once more ("pool hit": for `none` this
               is a recompute).
    multiturn  N conversations sharing an S-token system prompt, T rounds; each round sends every
               conversation's next prompt (history + a new user turn) in one `LLM.generate`
               call; the replies (max_tokens=M) join the history. Throughput and TTFT (vLLM's
               first_token_latency: arrival to first token, queueing included).

    python -m bench e2e_gpu --model bench/e2e_models/llama3-8b \
        --configs none,offloading,simple,kvo-layer --sections ttft,multiturn \
        [--socket PATH | --pool-gib 40] [--budget-s 540] [--out bench/out/e2e_gpu.json]

Writes the JSON after every finished section (a timeout leaves what was measured) and prints
the tables last. A request without progress for --stall-s is a hang: the child dumps
every thread's stack, saves and exits (the parent goes on).
On vLLM 0.26 the connector runs as shipped: its two 0.26 fixes (the result type's fallback in
`compat.py`, stores of steps without `wait_for_save` submitted from `get_finished`) are in the
connector itself.
`bash bench/gpu_run.sh e2e_gpu BUDGET_S [flags]` runs it on the GPU machine.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PCIE_GBPS = 52.0  # measured H2D ceiling on the H100 host (DESIGN.md; 52.5 in bench/transfer.py)
TARGET_SLACK = 1.1  # target: pool hit within 1.1 x (GPU-hit time + KV bytes / 52 GB/s)
CONFIGS = ("none", "offloading", "simple", "kvo-eager", "kvo-lazy", "kvo-layer")
SECTIONS = ("ttft", "multiturn")
CHILD_START_S = 60.0  # import + engine start + warm-up: do not start a child with less left


# -- workload: pure and deterministic ------------------------------------------------------------


def seed_of(*parts: object) -> int:
    """A stable 32-bit seed from any labels (crc32 of their text: identical across processes)."""
    return zlib.crc32("/".join(map(str, parts)).encode())


def token_prompt(seed: int, length: int, vocab: int) -> list[int]:
    """`length` random token ids in [10, vocab - 10): distinct seeds give disjoint prefixes."""
    if length <= 0:
        raise ValueError(f"prompt length must be positive, got {length}")
    if vocab < 100:
        raise ValueError(f"vocab too small for random prompts: {vocab}")
    x = seed & 0xFFFFFFFF or 1
    out = []
    for _ in range(length):  # xorshift32: no numpy needed, ~1 µs per token
        x ^= (x << 13) & 0xFFFFFFFF
        x ^= x >> 17
        x ^= (x << 5) & 0xFFFFFFFF
        out.append(10 + x % (vocab - 20))
    return out


@dataclass(frozen=True)
class ModelShape:
    """What the targets need from config.json: KV bytes per token, per layer kind."""

    name: str
    vocab: int
    full_layers: int
    sliding_layers: int
    sliding_window: int  # tokens (0: no sliding layers)
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def layer_token_bytes(self) -> int:
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes  # K and V

    def kv_bytes(self, tokens: int) -> int:
        """Bytes a prefix of `tokens` occupies: full layers keep every token, sliding layers
        only the last `sliding_window` (what a hit has to bring back at least)."""
        window = min(tokens, self.sliding_window) if self.sliding_layers else 0
        return self.layer_token_bytes * (self.full_layers * tokens + self.sliding_layers * window)


def model_shape(model_dir: Path) -> ModelShape:
    cfg = json.loads((model_dir / "config.json").read_text())
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or []
    sliding = sum(1 for t in types if t == "sliding_attention")
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    return ModelShape(
        name=model_dir.name,
        vocab=int(cfg["vocab_size"]),
        full_layers=layers - sliding,
        sliding_layers=sliding,
        sliding_window=int(cfg.get("sliding_window") or 0) if sliding else 0,
        kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
        head_dim=head_dim,
    )


def pool_hit_target_ms(gpu_hit_ms: float, kv_bytes: int, gbps: float = PCIE_GBPS) -> float:
    """The pool-hit target: 1.1 x (GPU-hit time + the bytes at the PCIe ceiling)."""
    return TARGET_SLACK * (gpu_hit_ms + kv_bytes / (gbps * 1e9) * 1e3)


def spread(values: Sequence[float]) -> dict[str, float] | None:
    """Median with its spread (min, max, count); None for no values."""
    vals = sorted(float(v) for v in values)
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": vals[0], "max": vals[-1], "n": len(vals)}


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sequence."""
    vals = sorted(values)
    if not vals:
        raise ValueError("percentile of no values")
    rank = max(1, math.ceil(q / 100 * len(vals)))
    return float(vals[rank - 1])


def filler_count(gpu_blocks: int, block_size: int, filler_tokens: int, margin: float = 1.1) -> int:
    """Fillers whose blocks together exceed the GPU cache by `margin`: every older block goes."""
    return max(1, math.ceil(margin * gpu_blocks * block_size / filler_tokens))


def kv_transfer_config(
    config: str, socket: str, cpu_bytes: int, kvo_chunk: int = 0
) -> dict[str, Any] | None:
    """The `kv_transfer_config` of one configuration (the same dict `--kv-transfer-config` takes).

    vLLM's two connectors get exactly what `--kv-offloading-size` would give them
    (`_post_init_kv_transfer_config`: the connector name, `kv_both`, `cpu_bytes_to_use`).
    The `+events=1` variant is the engine's (`--kv-events-config`, `kv_events_config`), not the
    connector's.
    """
    config = config.replace(EVENTS_VARIANT, "")
    if config == "none":
        return None
    if config in ("offloading", "simple"):
        name = "OffloadingConnector" if config == "offloading" else "SimpleCPUOffloadConnector"
        return {
            "kv_connector": name,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes},
        }
    base, *overrides = config.split("+")  # kvo-layer+store_ctas=1: extra_config overrides
    if base.startswith("kvo-") and base in CONFIGS:
        layered = base == "kvo-layer"
        extra = dict(o.split("=", 1) for o in overrides)
        return {
            "kv_connector": "KVOffloadConnector",
            "kv_connector_module_path": "kvoffload_connector.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "socket": socket,
                "mode": "eager" if layered else base.split("-")[1],
                "load_mode": "layered" if layered else "async",
                **({"chunk_size": kvo_chunk} if kvo_chunk else {}),
                **extra,
            },
        }
    raise ValueError(f"unknown configuration {config!r}; known: {', '.join(CONFIGS)}")


EVENTS_VARIANT = "+events=1"


def kv_events_config(config: str) -> Any:
    """`--kv-events-config` for a `+events=1` configuration: vLLM's ZMQ publisher on a free
    port (nobody need subscribe: publishing costs the engine the same), else None."""
    if EVENTS_VARIANT not in config:
        return None
    import socket

    from vllm.config import KVEventsConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}", topic="kv"
    )


def ordered_configs(names: Iterable[str]) -> list[str]:
    """Configuration names (not rounds) in CONFIGS order, each variant (`+key=value`) after
    its base."""
    found = {n for n in names if "#" not in n}
    return sorted(found, key=lambda c: (CONFIGS.index(c.split("+")[0]), c))


def parse_list(text: str, known: Sequence[str], what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t.split("+")[0] not in known]
    if bad or not items:
        raise argparse.ArgumentTypeError(
            f"{what}: {bad or 'none given'}; known: {', '.join(known)}"
        )
    return items


# -- one engine (child process) ------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One request as the benchmark saw it."""

    prompt_tokens: int
    wall_ms: float  # LLM.generate wall time (max_tokens=1: the TTFT)
    cached_tokens: int  # vLLM's num_cached_tokens: GPU prefix hit + connector hit
    ttft_ms: float | None  # vLLM: arrival -> first token
    wait_ms: float | None  # vLLM: queued -> scheduled (lookup + asynchronous load)
    compute_ms: float | None  # vLLM: scheduled -> first token (the prefill step(s))
    counters: dict[str, float] = field(default_factory=dict)  # metric deltas over the request
    first_token: int | None = None  # the greedy token: a pool hit must agree with the GPU hit


class Child:
    """Runs the asked sections on one engine and keeps `self.result` saved to `path`."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.deadline = args.deadline
        self.shape = model_shape(Path(args.model))
        self.path = Path(args.result)
        self.result: dict[str, Any] = {
            "model": self.shape.name,
            "config": args.config,
            "status": "starting",
            "sections": {},
        }
        self.llm: Any = None
        self.busy: tuple[float, int, int] | None = None  # (since, tokens, prompts) in generate()

    # plumbing
    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result, indent=1))
        tmp.replace(self.path)

    def left(self) -> float:
        return self.deadline - time.time()

    def failed(self, exc: BaseException) -> int:
        """Record the exception that ended this child (the parent reports it); exit code 1."""
        self.result["status"] = "error"
        self.result["error"] = f"{type(exc).__name__}: {exc}"
        self.result["traceback"] = traceback.format_exc()[-6000:]
        traceback.print_exc()
        return 1

    def log(self, msg: str) -> None:
        print(f"[e2e {self.args.config} {self.left():6.0f}s left] {msg}", flush=True)

    def prompt(self, length: int, *parts: object) -> list[int]:
        # The configuration is part of every seed: the sidecar outlives the engines (and two
        # kvoffload configurations share a namespace), so no configuration hits another's data.
        rnd = () if self.args.round <= 1 else (f"round{self.args.round}",)
        return token_prompt(seed_of(self.args.config, *rnd, *parts), length, self.shape.vocab)

    def start(self) -> None:
        from vllm import LLM

        a = self.args
        kv = kv_transfer_config(a.config, a.socket, int(a.cpu_gib * (1 << 30)), a.kvo_chunk)
        t0 = time.time()
        self.llm = LLM(
            model=a.model,
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype=a.dtype,
            enforce_eager=not a.cuda_graphs,
            block_size=a.block_size or None,
            seed=0,
            max_model_len=a.max_model_len,
            num_gpu_blocks_override=a.gpu_blocks,
            gpu_memory_utilization=a.gpu_mem_util,
            enable_prefix_caching=True,
            disable_log_stats=False,
            kv_transfer_config=kv,
            kv_events_config=kv_events_config(a.config),
        )
        vc = self.llm.llm_engine.vllm_config
        import vllm

        core = getattr(self.llm.llm_engine.engine_core, "engine_core", None)  # in-process only
        kcc = getattr(getattr(core, "scheduler", None), "kv_cache_config", None)
        groups = [
            f"{type(g.kv_cache_spec).__name__}x{len(g.layer_names)}"
            for g in getattr(kcc, "kv_cache_groups", None) or []
        ]
        self.block_size = int(vc.cache_config.block_size)
        self.result["engine"] = {
            "vllm": vllm.__version__,
            "start_s": round(time.time() - t0, 1),
            "kv_transfer_config": kv,
            "block_size": self.block_size,
            "num_gpu_blocks": vc.cache_config.num_gpu_blocks,
            "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
            "max_num_seqs": vc.scheduler_config.max_num_seqs,
            "max_model_len": vc.model_config.max_model_len,
            "hybrid_kv_cache_manager": not vc.scheduler_config.disable_hybrid_kv_cache_manager,
            "kv_groups": groups,
            "enforce_eager": not a.cuda_graphs,
            "cudagraph_mode": str(getattr(vc.compilation_config, "cudagraph_mode", None)),
            "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1"),
        }
        self.save()

    def params(self, max_tokens: int) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False
        )

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[Any], float]:
        t0 = time.perf_counter()
        self.busy = (time.time(), sum(len(p) for p in prompts), len(prompts))
        try:
            outs = self.llm.generate(
                [{"prompt_token_ids": p} for p in prompts], self.params(max_tokens), use_tqdm=False
            )
        finally:
            self.busy = None
        return outs, time.perf_counter() - t0

    def watchdog(self, stall_s: float) -> None:
        """A request that makes no progress for `stall_s` is a hang: dump every thread's stack,
        save, and exit (the parent goes on)."""

        def watch() -> None:
            while True:
                time.sleep(1.0)
                busy = self.busy
                if busy is None or time.time() - busy[0] < stall_s:
                    continue
                self.log(
                    f"STALL: one generate() of {busy[2]} prompt(s), {busy[1]} tokens, "
                    f"running for {time.time() - busy[0]:.0f} s"
                )
                self.result["status"] = "hung"
                self.result["error"] = f"no progress for {stall_s:.0f} s ({busy[1]} tokens)"
                faulthandler.dump_traceback(all_threads=True)
                sys.stdout.flush()
                self.save()
                os._exit(3)

        threading.Thread(target=watch, name="e2e-watchdog", daemon=True).start()

    def counters(self) -> dict[str, float]:
        """Counter values from vLLM's metrics (prefix cache, connector, preemptions)."""
        keep = ("prefix_cache", "kvoffload", "preemption", "prompt_tokens_by_source")
        out: dict[str, float] = {}
        try:
            metrics = self.llm.get_metrics()
        except Exception:  # noqa: BLE001 - metrics are an aid, never a reason to stop
            return out
        for m in metrics:
            if type(m).__name__ != "Counter" or not any(k in m.name for k in keep):
                continue
            label = m.labels.get("source")
            name = f"{m.name}[{label}]" if label else m.name
            out[name] = out.get(name, 0.0) + float(m.value)
        return out

    def timed(self, prompt: list[int], settle_s: float | None = None) -> Sample:
        """One request alone, max_tokens=1, after a pause that lets earlier copies settle."""
        time.sleep(self.args.settle_s if settle_s is None else settle_s)
        before = self.counters()
        outs, wall = self.generate([prompt], 1)
        after = self.counters()
        o = outs[0]
        m = getattr(o, "metrics", None)
        ttft = wait = compute = None
        if m is not None and getattr(m, "first_token_latency", 0):
            ttft = 1e3 * m.first_token_latency
            if m.scheduled_ts and m.queued_ts:
                wait = 1e3 * (m.scheduled_ts - m.queued_ts)
                compute = 1e3 * (m.first_token_ts - m.scheduled_ts)
        delta = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
        tokens = o.outputs[0].token_ids if o.outputs else ()
        return Sample(
            len(prompt),
            1e3 * wall,
            int(o.num_cached_tokens or 0),
            ttft,
            wait,
            compute,
            delta,
            int(tokens[0]) if tokens else None,
        )

    def warmup(self) -> None:
        """Kernels, allocator and (kvoffload) the pool mapping, before anything is timed."""
        t0 = time.time()
        for n in sorted({512, min(8192, max(self.args.sizes)), max(self.args.sizes)}):
            self.generate([self.prompt(n, "warm", n)], 1)
        self.generate([self.prompt(256, "warm-batch", i) for i in range(8)], 16)
        if self.args.config.startswith("kvo"):
            self.result["engine"]["pool_ready_s"] = self.wait_pool_ready()
        self.result["engine"]["warmup_s"] = round(time.time() - t0, 1)
        self.save()

    def wait_pool_ready(self, timeout_s: float = 90.0) -> float | None:
        """Step the engine until the worker has mapped and CUDA-registered its pool region.

        Until then every kvoffload job fails fast (a miss), which would turn the first
        measurements into misses. The worker lives in this process
        (VLLM_ENABLE_V1_MULTIPROCESSING=0), so its readiness is read directly.
        """
        try:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            worker = getattr(get_kv_transfer_group(), "_worker", None)
        except Exception:  # noqa: BLE001
            worker = None
        t0 = time.time()
        while time.time() - t0 < timeout_s:
            ready = getattr(worker, "ready", None)
            self.generate([self.prompt(64, "ready", time.time())], 1)  # lets the engine step
            if ready is True:
                self.generate([self.prompt(64, "ready2", time.time())], 1)  # report reaches it
                return round(time.time() - t0, 2)
            if ready is None:  # no readiness to read: give registration a fixed grace
                time.sleep(min(10.0, timeout_s))
                return None
            time.sleep(0.2)
        self.log("pool not ready in time: kvoffload measurements will be misses")
        return None

    def flush(self, tag: object) -> dict[str, Any]:
        """Push everything out of the GPU prefix cache with new filler prompts (real traffic)."""
        a = self.args
        n = a.fillers or filler_count(
            self.result["engine"]["num_gpu_blocks"], self.block_size, a.filler_tokens
        )
        t0 = time.time()
        for i in range(n):
            self.generate([self.prompt(a.filler_tokens, "filler", tag, i)], 1)
        return {
            "fillers": n,
            "filler_tokens": a.filler_tokens,
            "seconds": round(time.time() - t0, 2),
        }

    # sections
    def section_ttft(self) -> None:
        a = self.args
        sec: dict[str, Any] = {"sizes": a.sizes, "reps": a.reps, "samples": {}, "complete": False}
        self.result["sections"]["ttft"] = sec
        prompts = {s: [self.prompt(s, "ttft", s, i) for i in range(a.reps)] for s in a.sizes}

        def add(size: int, phase: str, sample: Sample) -> None:
            sec["samples"].setdefault(f"{size}/{phase}", []).append(asdict(sample))

        done: dict[int, int] = {}
        rate = 20_000.0  # prefill tokens/s, updated from each cold sample (for the time budget)
        fillers = a.fillers or filler_count(
            self.result["engine"]["num_gpu_blocks"], self.block_size, a.filler_tokens
        )
        for size in a.sizes:
            for i, p in enumerate(prompts[size]):
                # keep time for this pair, the flush and a pool-hit run of everything done so far
                later = fillers * a.filler_tokens / rate + sum(
                    n * (s / rate + 2 * a.settle_s) for s, n in done.items()
                )
                if self.left() < a.reserve_s + later + 2 * (size / rate + a.settle_s):
                    self.log(f"ttft: out of time at {size} rep {i}")
                    break
                cold = self.timed(p)
                add(size, "cold", cold)
                rate = max(1000.0, size / max(cold.wall_ms / 1e3, 1e-3))
                add(size, "gpu_hit", self.timed(p))
                done[size] = i + 1
            self.save()
        sec["flush"] = self.flush("ttft")
        self.save()
        for size in a.sizes:
            for p in prompts[size][: done.get(size, 0)]:
                if self.left() < a.reserve_s:
                    break
                add(size, "pool_hit", self.timed(p))
        sec["complete"] = all(done.get(s) == a.reps for s in a.sizes)
        self.save()

    def section_multiturn(self) -> None:
        a = self.args
        sec: dict[str, Any] = {
            "conversations": a.mt_convs,
            "system_tokens": a.mt_system,
            "turn_tokens": a.mt_turn,
            "reply_tokens": a.mt_reply,
            "rounds": [],
            "complete": False,
        }
        self.result["sections"]["multiturn"] = sec
        system = self.prompt(a.mt_system, "mt-system")
        history: list[list[int]] = [[] for _ in range(a.mt_convs)]
        before = self.counters()
        for turn in range(a.mt_turns):
            if self.left() < a.reserve_s + 20:
                self.log(f"multiturn: out of time before round {turn}")
                break
            batch = [
                system + history[c] + self.prompt(a.mt_turn, "mt", c, turn)
                for c in range(a.mt_convs)
            ]
            outs, wall = self.generate(batch, a.mt_reply)
            ttfts = [1e3 * o.metrics.first_token_latency for o in outs if o.metrics is not None]
            for c, o in enumerate(outs):
                history[c] = batch[c][len(system) :] + list(o.outputs[0].token_ids)
            sec["rounds"].append(
                {
                    "wall_s": wall,
                    "prompt_tokens": sum(len(p) for p in batch),
                    "cached_tokens": sum(int(o.num_cached_tokens or 0) for o in outs),
                    "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                    "ttft_ms": ttfts,
                }
            )
            self.save()
        after = self.counters()
        sec["counters"] = {
            k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)
        }
        sec["complete"] = len(sec["rounds"]) == a.mt_turns
        self.save()

    def run(self) -> int:
        try:
            self.log("starting engine")
            self.start()
            self.watchdog(self.args.stall_s)
            self.log(f"engine up in {self.result['engine']['start_s']} s; warming up")
            self.warmup()
            for name in self.args.sections:
                if self.left() < self.args.reserve_s + 10:
                    self.log(f"skipping {name}: out of time")
                    continue
                self.log(f"section {name}")
                getattr(self, f"section_{name}")()
            self.result["status"] = "ok"
            return 0
        except Exception as e:  # noqa: BLE001 - the parent records it and goes on
            return self.failed(e)
        finally:
            self.save()


# -- the parent: sidecar, one child per configuration, tables --------------------------------------


def sidecar_stats(socket: str) -> dict[str, Any] | None:
    try:
        import grpc
        from google.protobuf.json_format import MessageToDict
        from kvoffload.v1 import pool_pb2, pool_pb2_grpc

        with grpc.insecure_channel(f"unix://{socket}") as ch:
            resp = pool_pb2_grpc.KVPoolStub(ch).Stats(pool_pb2.StatsRequest(), timeout=5.0)
        return MessageToDict(resp)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


def child_argv(
    args: argparse.Namespace, config: str, result: Path, deadline: float, rnd: int = 1
) -> list[str]:
    keep = (
        "model",
        "socket",
        "cpu_gib",
        "max_model_len",
        "gpu_blocks",
        "gpu_mem_util",
        "dtype",
        "block_size",
        "kvo_chunk",
        "filler_tokens",
        "fillers",
        "reps",
        "settle_s",
        "reserve_s",
        "stall_s",
        "mt_convs",
        "mt_system",
        "mt_turn",
        "mt_reply",
        "mt_turns",
    )
    flags = ("cuda_graphs",)
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "--config",
        config,
        "--result",
        str(result),
        "--deadline",
        f"{deadline:.1f}",
        "--round",
        str(rnd),
        "--sections",
        ",".join(args.sections),
        "--sizes",
        ",".join(map(str, args.sizes)),
    ]
    for k in keep:
        argv += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    argv += [f"--{k.replace('_', '-')}" for k in flags if getattr(args, k)]
    return argv


def run_parent(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t_end = time.time() + args.budget_s
    shape = model_shape(Path(args.model))
    report: dict[str, Any] = {
        "bench": "e2e_gpu",
        "model": shape.name,
        "shape": asdict(shape),
        "argv": sys.argv[1:],
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": os.uname().nodename,
        "runs": {},
    }
    try:  # not torch: a CUDA context in this process would hold GPU memory all run long
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        report["gpu"] = smi.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        report["gpu"] = "none"
    sidecar = None
    if any(c.startswith("kvo") for c in args.configs) and not args.socket:
        sys.path[:0] = [str(ROOT / p) for p in ("connector", "sidecar", "protos/gen", "cli")]
        from kvoffload_cli.sidecar_child import SidecarProcess

        sidecar = SidecarProcess(f"{args.pool_gib}Gi", log_path=out.with_suffix(".sidecar.log"))
        sidecar.start(timeout_s=60)
        args.socket = sidecar.socket
    log_path = Path(args.log) if args.log else out.with_suffix(".log")
    try:
        # --rounds N: the configuration list N times over (A, B, A, B, ...), so machine drift
        # hits every configuration alike; round r > 1 is stored as "config#r"
        order = [(r, c) for r in range(1, args.rounds + 1) for c in args.configs]
        for rnd, config in order:
            key = config if rnd == 1 else f"{config}#{rnd}"
            left = t_end - time.time()
            if left < CHILD_START_S:
                report["runs"][key] = {"config": config, "status": "skipped: out of time"}
                continue
            result = out.with_name(f"{out.stem}.{key}.part.json")
            result.unlink(missing_ok=True)
            # the first engine of a fresh machine pays CUDA, model-cache and pinned-memory
            # warm-up (measured 67-115 s against 15-20 s later): give it that much more
            first = args.first_start_s if (rnd, config) == order[0] else 0.0
            if args.cuda_graphs and rnd == 1:  # each configuration compiles on its first start
                first += args.compile_s
            deadline = (
                t_end
                if (rnd, config) == order[-1]
                else time.time() + min(left, args.config_budget_s + first)
            )
            print(f"== {shape.name} / {key}: {deadline - time.time():.0f} s", flush=True)
            with open(log_path, "a") as log:
                log.write(f"\n===== {shape.name} / {key} =====\n")
                log.flush()
                try:
                    proc = subprocess.run(
                        child_argv(args, config, result, deadline - 5, rnd),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        timeout=max(10.0, deadline - time.time() + 15),
                        check=False,
                    )
                    rc: int | str = proc.returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            try:
                run = json.loads(result.read_text())
                result.unlink()
            except (OSError, ValueError):
                run = {"config": config, "status": "no result"}
            run["returncode"] = rc
            if config.startswith("kvo"):
                run["sidecar_stats"] = sidecar_stats(args.socket)
            run["round"] = rnd
            report["runs"][key] = run
            report["tables"] = tables(report)
            out.write_text(json.dumps(report, indent=1))
            tail = "" if rc == 0 else f" (rc {rc}: {run.get('error', 'see log')})"
            print(f"   {key}: {run.get('status')}{tail}", flush=True)
    finally:
        if sidecar is not None:
            sidecar.close()
    report["tables"] = tables(report)
    out.write_text(json.dumps(report, indent=1))
    print("\n".join(report["tables"]))
    return 0


# -- tables ------------------------------------------------------------------------------------


def _cell(s: dict[str, float] | None, digits: int = 0) -> str:
    if not s:
        return "-"
    fmt = f"{{:.{digits}f}}"
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"


def ttft_summary(run: dict[str, Any]) -> dict[str, dict[str, float] | None]:
    """'size/phase' -> spread of wall ms (every sample; the hit fractions are reported beside)."""
    out: dict[str, dict[str, float] | None] = {}
    for key, samples in run.get("sections", {}).get("ttft", {}).get("samples", {}).items():
        out[key] = spread([s["wall_ms"] for s in samples])
    return out


def tables(report: dict[str, Any]) -> list[str]:
    runs = report["runs"]
    shape = ModelShape(**report["shape"])
    configs = ordered_configs(runs)
    lines = [
        f"model {report['model']}, GPU {report.get('gpu')}; ms: median (min-max) of wall "
        "time of one LLM.generate(max_tokens=1)"
    ]
    summaries = {c: ttft_summary(runs[c]) for c in configs}
    sizes = sorted({int(k.split("/")[0]) for s in summaries.values() for k in s})
    if sizes:
        head = ["prompt", "phase", *configs, "target"]
        rows = [head]
        for size in sizes:
            for phase in ("cold", "gpu_hit", "pool_hit"):
                row = [f"{size:,}", phase]
                for c in configs:
                    row.append(_cell(summaries[c].get(f"{size}/{phase}")))
                target = "-"
                if phase == "pool_hit":
                    gpu = [
                        summaries[c].get(f"{size}/gpu_hit") for c in configs if c.startswith("kvo")
                    ]
                    gpu = [g for g in gpu if g]
                    if gpu:
                        t = pool_hit_target_ms(min(g["median"] for g in gpu), shape.kv_bytes(size))
                        target = f"<= {t:.0f}"
                row.append(target)
                rows.append(row)
        lines += ["", *_format(rows)]
        hits = []
        for c in configs:
            for key, samples in (
                runs[c].get("sections", {}).get("ttft", {}).get("samples", {}).items()
            ):
                if key.endswith("pool_hit"):
                    cached = [s["cached_tokens"] / s["prompt_tokens"] for s in samples]
                    local = [
                        s.get("counters", {}).get("vllm:prefix_cache_hits", 0) / s["prompt_tokens"]
                        for s in samples
                    ]
                    hits.append(
                        f"{c} {key.split('/')[0]}: {statistics.fmean(cached):.0%}"
                        + (f" (GPU {statistics.fmean(local):.0%})" if any(local) else "")
                    )
        agree = []
        for c in configs:
            samples = runs[c].get("sections", {}).get("ttft", {}).get("samples", {})
            for size in sizes:
                pairs = [
                    (g.get("first_token"), h.get("first_token"))
                    for g, h in zip(  # fewer pool hits where time ran out
                        samples.get(f"{size}/gpu_hit", []),
                        samples.get(f"{size}/pool_hit", []),
                        strict=False,
                    )
                    if g.get("first_token") is not None
                ]
                if pairs:
                    same = sum(g == h for g, h in pairs)
                    agree.append(f"{c} {size}: {same}/{len(pairs)}")
        if agree:
            lines.append("pool-hit first token equal to the GPU hit's: " + "; ".join(agree))
        if hits:
            lines.append(
                "pool-hit phase, prompt tokens not recomputed (of which from the GPU prefix "
                "cache, if any): " + "; ".join(hits)
            )
    mt_rows = [["multi-turn", "wall s", "tok/s", "TTFT mean ms", "TTFT p99 ms", "cached"]]
    for c in configs:
        sec = runs[c].get("sections", {}).get("multiturn")
        if not sec or not sec.get("rounds"):
            continue
        rounds = sec["rounds"]
        wall = sum(r["wall_s"] for r in rounds)
        toks = sum(r["prompt_tokens"] + r["generated_tokens"] for r in rounds)
        ttft = [t for r in rounds for t in r["ttft_ms"]]
        cached = sum(r["cached_tokens"] for r in rounds) / max(
            1, sum(r["prompt_tokens"] for r in rounds)
        )
        partial = "" if sec.get("complete") else f" ({len(rounds)} rounds)"
        mt_rows.append(
            [
                c + partial,
                f"{wall:.1f}",
                f"{toks / wall:,.0f}",
                f"{statistics.fmean(ttft):.0f}" if ttft else "-",
                f"{percentile(ttft, 99):.0f}" if ttft else "-",
                f"{cached:.0%}",
            ]
        )
    if len(mt_rows) > 1:
        lines += ["", *_format(mt_rows)]
    bad = [
        f"{c}: {runs[c].get('status')} {runs[c].get('error', '')}".strip()
        for c in runs
        if runs[c].get("status") != "ok"
    ]
    if bad:
        lines += ["", "not ok: " + "; ".join(bad)]
    return lines


def _format(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]


# -- command line ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--model", default=str(ROOT / "bench/e2e_models/llama3-8b"))
    p.add_argument(
        "--configs", default=",".join(CONFIGS), type=lambda s: parse_list(s, CONFIGS, "configs")
    )
    p.add_argument(
        "--sections", default=",".join(SECTIONS), type=lambda s: parse_list(s, SECTIONS, "sections")
    )
    p.add_argument("--sizes", default="2000,10000,32000", type=ints, help="TTFT prompt lengths")
    p.add_argument("--reps", type=int, default=4, help="prompts per size (medians of these)")
    p.add_argument("--out", default=str(ROOT / "bench/out/e2e_gpu.json"))
    p.add_argument("--log", default="", help="engines' output (default: OUT with .log)")
    p.add_argument("--budget-s", type=float, default=540, help="wall budget of the whole run")
    p.add_argument(
        "--rounds", type=int, default=1, help="run the configuration list this many times over"
    )
    p.add_argument(
        "--config-budget-s",
        type=float,
        default=200,
        help="cap per configuration (a fresh GPU machine took 49-73 s to start one engine)",
    )
    p.add_argument("--socket", default="", help="a running sidecar's socket (else one is started)")
    p.add_argument("--pool-gib", type=int, default=40, help="pool size of a started sidecar")
    p.add_argument("--cpu-gib", type=float, default=40, help="vLLM connectors' CPU capacity")
    p.add_argument("--max-model-len", type=int, default=40960)
    p.add_argument("--gpu-blocks", type=int, default=5000, help="num_gpu_blocks_override")
    p.add_argument("--gpu-mem-util", type=float, default=0.9)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kvo-chunk", type=int, default=0, help="kvoffload chunk_size (0: default)")
    p.add_argument("--block-size", type=int, default=0, help="0: vLLM's default (16 on CUDA)")
    p.add_argument("--filler-tokens", type=int, default=30000)
    p.add_argument(
        "--fillers",
        type=int,
        default=0,
        help="filler prompts per flush (0: enough tokens for 1.1 x the GPU cache; a hybrid "
        "model cycles every KV group's blocks, so fewer suffice there)",
    )
    p.add_argument(
        "--first-start-s",
        type=float,
        default=60,
        help="extra seconds for the first configuration (a fresh machine's first engine start)",
    )
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="vLLM's default compile and CUDA graphs (FULL_AND_PIECEWISE) instead of enforce_eager",
    )
    p.add_argument(
        "--compile-s",
        type=float,
        default=45,
        help="with --cuda-graphs: extra seconds for each configuration's first start (its "
        "torch.compile; measured 35-60 s against 15-25 s for a cached restart)",
    )
    p.add_argument("--settle-s", type=float, default=0.25, help="pause before each timed request")
    p.add_argument("--stall-s", type=float, default=45, help="a generate() this long is a hang")
    p.add_argument("--reserve-s", type=float, default=8, help="time kept for shutdown")
    p.add_argument("--mt-convs", type=int, default=64)
    p.add_argument("--mt-system", type=int, default=8192)
    p.add_argument("--mt-turn", type=int, default=500)
    p.add_argument("--mt-reply", type=int, default=32)
    p.add_argument("--mt-turns", type=int, default=4)
    # child-only
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", default="none", help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=1, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.reps < 1 or not args.sizes or min(args.sizes) < 16:
        raise SystemExit("--reps must be >= 1 and every --sizes entry >= 16 tokens")
    if max(args.sizes) >= args.max_model_len or args.filler_tokens >= args.max_model_len:
        raise SystemExit("--sizes and --filler-tokens must stay below --max-model-len")
    if args.child:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        if not args.deadline:
            args.deadline = time.time() + args.budget_s
        return Child(args).run()
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
