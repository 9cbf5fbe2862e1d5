"""End to end on the GPU: a real vLLM engine (`LLM`) with kvoffload, beside vLLM's own offloading.

Each engine runs in a child process of its own (clean GPU and host memory; a crash costs one
child), all against one real `kvoffload sidecar`. Configurations: `none` (recompute),
`offloading` and `simple` (vLLM's OffloadingConnector and SimpleCPUOffloadConnector with
--cpu-gib), `kvo-eager` / `kvo-lazy` (stores as computed / only of blocks about to leave the
GPU; hits loaded before the step), `kvo-layer` (as shipped: eager stores, layered loads);
`+key=value` overrides a connector key, `+events=1` turns on vLLM's KV events. Sections:

    ttft        per size, R prompts run cold and again (GPU hit), then filler prompts evict
                them (real traffic) and each runs once more ("pool hit"; for none a
                recompute); max_tokens=1, TTFT = `LLM.generate` wall time; every pool hit's
                first token is compared with the GPU hit's
    multiturn   N conversations sharing an S-token system prompt, T rounds of one
                `LLM.generate` each; wall time, TTFT, preemptions
    warm_start  (alone; bench/gpu_run.sh warm_start has its sizes) every child a fresh engine
                whose FIRST request is the --sizes prompt, then the same again (a GPU hit); a
                kvo seed child stores it and waits for the commits; --reps rotated rounds;
                --sidecar-restart: after round 1 the sidecar is SIGKILLed and restarted (it
                adopts its pool file) and one more kvo child runs

The JSON is written after every child, the tables last; a generate() without progress for
--stall-s dumps every thread's stack and ends that child. Children get PYTHONHASHSEED=0 unless
set (a restarted engine's block hashes must match the pool's, as the injector ensures).

    bash bench/gpu_run.sh e2e_gpu BUDGET_S --configs none,offloading,simple,kvo-layer [flags]
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
for _p in ("bench", "connector", "sidecar", "protos/gen", "cli"):
    if str(ROOT / _p) not in sys.path:
        sys.path.insert(0, str(ROOT / _p))

from harness import cell, machine, percentile, rotations, table  # noqa: E402

PCIE_GBPS = 52.0  # measured H2D ceiling on the H100 host (bench/transfer.py)
TARGET_SLACK = 1.1  # target: pool hit within 1.1 x (GPU-hit time + KV bytes / 52 GB/s)
CONFIGS = ("none", "offloading", "simple", "kvo-eager", "kvo-lazy", "kvo-layer")
SECTIONS = ("ttft", "multiturn", "warm_start")
EVENTS_VARIANT = "+events=1"
CHILD_START_S = 60.0  # import + engine start + warm-up: do not start a child with less left


# -- workload and targets: pure and deterministic -----------------------------------------------


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

    def kv_bytes(self, tokens: int) -> int:
        """Bytes a prefix of `tokens` occupies: full layers keep every token, sliding layers
        only the last `sliding_window` (what a hit has to bring back at least)."""
        window = min(tokens, self.sliding_window) if self.sliding_layers else 0
        per_token = 2 * self.kv_heads * self.head_dim * self.dtype_bytes  # K and V
        return per_token * (self.full_layers * tokens + self.sliding_layers * window)


def model_shape(model_dir: Path) -> ModelShape:
    cfg = json.loads((model_dir / "config.json").read_text())
    layers = int(cfg["num_hidden_layers"])
    sliding = sum(1 for t in cfg.get("layer_types") or [] if t == "sliding_attention")
    return ModelShape(
        name=model_dir.name,
        vocab=int(cfg["vocab_size"]),
        full_layers=layers - sliding,
        sliding_layers=sliding,
        sliding_window=int(cfg.get("sliding_window") or 0) if sliding else 0,
        kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]),
    )


def pool_hit_target_ms(gpu_hit_ms: float, kv_bytes: int, gbps: float = PCIE_GBPS) -> float:
    """The pool-hit target: 1.1 x (GPU-hit time + the bytes at the PCIe ceiling)."""
    return TARGET_SLACK * (gpu_hit_ms + kv_bytes / (gbps * 1e9) * 1e3)


def filler_count(gpu_blocks: int, block_size: int, filler_tokens: int, margin: float = 1.1) -> int:
    """Fillers whose blocks together exceed the GPU cache by `margin`: every older block goes."""
    return max(1, math.ceil(margin * gpu_blocks * block_size / filler_tokens))


def kv_transfer_config(
    config: str, socket: str, cpu_bytes: int, kvo_chunk: int = 0
) -> dict[str, Any] | None:
    """The `kv_transfer_config` of one configuration (the dict `--kv-transfer-config` takes).
    vLLM's two connectors get exactly what `--kv-offloading-size` would give them."""
    config = config.replace(EVENTS_VARIANT, "")
    if config == "none":
        return None
    if config in ("offloading", "simple"):
        name = "OffloadingConnector" if config == "offloading" else "SimpleCPUOffloadConnector"
        extra = {"cpu_bytes_to_use": cpu_bytes}
        return {"kv_connector": name, "kv_role": "kv_both", "kv_connector_extra_config": extra}
    base, *overrides = config.split("+")  # kvo-layer+store_ctas=1: extra_config overrides
    if base.startswith("kvo-") and base in CONFIGS:
        layered = base == "kvo-layer"
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
                **dict(o.split("=", 1) for o in overrides),
            },
        }
    raise ValueError(f"unknown configuration {config!r}; known: {', '.join(CONFIGS)}")


def kv_events_config(config: str) -> Any:
    """vLLM's ZMQ publisher on a free port for a `+events=1` configuration (nobody need
    subscribe: publishing costs the engine the same), else None."""
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


def parse_list(text: str, known: Sequence[str], what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items or (bad := [t for t in items if t.split("+")[0] not in known]):
        why = bad if items else "none given"
        raise argparse.ArgumentTypeError(f"{what}: {why}; known: {', '.join(known)}")
    return items


def sidecar_stats(socket: str) -> dict[str, Any]:
    """The sidecar's Stats as a dict (camelCase, as protobuf's JSON); {"error"} when it does
    not answer."""
    try:
        import grpc
        from google.protobuf.json_format import MessageToDict
        from kvoffload.v1 import pool_pb2, pool_pb2_grpc

        with grpc.insecure_channel(f"unix://{socket}") as ch:
            resp = pool_pb2_grpc.KVPoolStub(ch).Stats(pool_pb2.StatsRequest(), timeout=5.0)
        return MessageToDict(resp)
    except Exception as e:  # noqa: BLE001 - a missing sidecar is a result here
        return {"error": f"{type(e).__name__}: {e}"}


def pool_total(stats: dict[str, Any], key: str) -> int:
    """A namespace counter of `sidecar_stats`, summed over the namespaces."""
    return sum(int(ns.get(key, 0)) for ns in stats.get("namespaces", []))


# -- one engine (child process) ------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One request as the benchmark saw it."""

    prompt_tokens: int
    wall_ms: float  # LLM.generate wall time (max_tokens=1: the TTFT)
    cached_tokens: int  # vLLM's num_cached_tokens: GPU prefix hit + connector hit
    counters: dict[str, float] = field(default_factory=dict)  # metric deltas over the request
    first_token: int | None = None  # the greedy token: a pool hit must agree with the GPU hit


class Child:
    """Runs the asked sections on one engine and keeps `self.result` saved to `path`."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.shape = model_shape(Path(args.model))
        self.path = Path(args.result)
        self.result: dict[str, Any] = {"config": args.config, "status": "starting", "sections": {}}
        self.llm: Any = None
        self.busy: tuple[float, int, int] | None = None  # (since, tokens, prompts) in generate()
        self.submitted = 0.0  # when the last timed request went in

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result, indent=1))
        tmp.replace(self.path)

    def left(self) -> float:
        return self.args.deadline - time.time()

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
            num_gpu_blocks_override=a.gpu_blocks or None,
            gpu_memory_utilization=a.gpu_mem_util,
            enable_prefix_caching=True,
            disable_log_stats=False,
            kv_transfer_config=kv,
            kv_events_config=kv_events_config(a.config),
        )
        import vllm

        vc = self.llm.llm_engine.vllm_config
        self.block_size = int(vc.cache_config.block_size)
        self.result["since_spawn"] = {"llm_ready": round(time.time() - a.spawned, 3)}
        self.result["engine"] = {
            "vllm": vllm.__version__,
            "start_s": round(time.time() - t0, 1),
            "kv_transfer_config": kv,
            "block_size": self.block_size,
            "num_gpu_blocks": vc.cache_config.num_gpu_blocks,
            "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
            "max_num_seqs": vc.scheduler_config.max_num_seqs,
            "cudagraph_mode": str(getattr(vc.compilation_config, "cudagraph_mode", None)),
        }
        self.save()

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[Any], float]:
        from vllm import SamplingParams

        params = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False
        )
        t0 = time.perf_counter()
        self.busy = (time.time(), sum(len(p) for p in prompts), len(prompts))
        try:
            outs = self.llm.generate(
                [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
            )
        finally:
            self.busy = None
        return outs, time.perf_counter() - t0

    def watchdog(self, stall_s: float) -> None:
        """A request without progress for `stall_s` is a hang: dump every thread's stack, save,
        and exit (the parent goes on)."""

        def watch() -> None:
            while True:
                time.sleep(1.0)
                busy = self.busy
                if busy is None or time.time() - busy[0] < stall_s:
                    continue
                self.log(f"STALL: {busy[2]} prompt(s), {busy[1]} tokens, {stall_s:.0f} s")
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
        self.submitted = time.time()
        outs, wall = self.generate([prompt], 1)
        after = self.counters()
        o = outs[0]
        delta = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
        tokens = o.outputs[0].token_ids if o.outputs else ()
        first = int(tokens[0]) if tokens else None
        return Sample(len(prompt), 1e3 * wall, int(o.num_cached_tokens or 0), delta, first)

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

    def kvo_worker(self) -> Any:
        """The connector's worker (the engine is in this process), or None."""
        try:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            return getattr(get_kv_transfer_group(), "_worker", None)
        except Exception:  # noqa: BLE001
            return None

    def wait_pool_ready(self, timeout_s: float = 90.0) -> float | None:
        """Step the engine until the worker has mapped and CUDA-registered its pool region:
        until then every kvoffload job fails fast (a miss), which would turn the first
        measurements into misses."""
        worker = self.kvo_worker()
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
        return {"fillers": n, "filler_tokens": a.filler_tokens, "seconds": time.time() - t0}

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
        sec: dict[str, Any] = {"conversations": a.mt_convs, "rounds": [], "complete": False}
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
            for c, o in enumerate(outs):
                history[c] = batch[c][len(system) :] + list(o.outputs[0].token_ids)
            sec["rounds"].append(
                {
                    "wall_s": wall,
                    "prompt_tokens": sum(len(p) for p in batch),
                    "cached_tokens": sum(int(o.num_cached_tokens or 0) for o in outs),
                    "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                    "ttft_ms": [1e3 * o.metrics.first_token_latency for o in outs if o.metrics],
                }
            )
            self.save()
        after = self.counters()
        sec["counters"] = {k: v - before.get(k, 0.0) for k, v in after.items()}
        sec["complete"] = len(sec["rounds"]) == a.mt_turns
        self.save()

    def section_warm_start(self) -> None:
        """The restarted engine's first request (at once: what a restarted server's first
        client sees), then the same prompt again (a GPU hit); a kvo seed then waits until the
        pool committed the prompt (no request meanwhile: the in-process connector sends a
        step's stores with that step, docs/CONNECTOR.md)."""
        a = self.args
        kvo = a.config.startswith("kvo")
        size = a.sizes[0]
        prompt = token_prompt(seed_of("warm-start", size), size, self.shape.vocab)
        requests = self.result.setdefault("requests", [])
        for name in ("first", "gpu_hit"):
            before = sidecar_stats(a.socket) if kvo else {}
            sample = self.timed(prompt, settle_s=0.0 if name == "first" else a.settle_s)
            done = time.time()
            rec = {"name": name, **asdict(sample), "hit": sample.cached_tokens / size}
            rec["submit_s"] = round(self.submitted - a.spawned, 3)
            rec["done_s"] = round(done - a.spawned, 3)
            if kvo:
                after = sidecar_stats(a.socket)
                keys = ("hitBlocks", "loadedBlocks", "storedBlocks")
                rec["sidecar"] = {k: pool_total(after, k) - pool_total(before, k) for k in keys}
            requests.append(rec)
            self.log(f"{name}: {sample.wall_ms:.0f} ms, cached {sample.cached_tokens}/{size}")
            self.save()
            if a.role == "seed":
                break
        worker = self.kvo_worker()
        if kvo and a.role == "seed" and worker is not None:
            need = size // int(worker.chunk_blocks * worker.block_size)
            self.result["stores"] = self.wait_stored(need)

    def wait_stored(self, need: int) -> dict[str, Any]:
        """Until the pool holds `need` committed chunks with no store open, stable 0.5 s
        (bounded by --store-wait-s): the engine's stores land before this process exits."""
        t0 = time.time()
        last, since, st = -1, t0, {}
        while time.time() - t0 < self.args.store_wait_s:
            st = sidecar_stats(self.args.socket)
            committed, open_ = pool_total(st, "committedSlots"), pool_total(st, "reservedSlots")
            if committed != last or open_ or committed < need:
                last, since = committed, time.time()
            elif time.time() - since >= 0.5:
                break
            time.sleep(0.05)
        committed = pool_total(st, "committedSlots")
        complete = committed >= need and not pool_total(st, "reservedSlots")
        wait_s = round(time.time() - t0, 2)
        return {"need_chunks": need, "committed": committed, "complete": complete, "s": wait_s}

    def run(self) -> int:
        a = self.args
        try:
            self.log("starting engine")
            self.start()
            self.watchdog(a.stall_s)
            self.log(f"engine up in {self.result['engine']['start_s']} s")
            if "warm_start" not in a.sections:
                self.warmup()
            for name in a.sections:
                if self.left() < a.reserve_s + 10:
                    self.log(f"skipping {name}: out of time")
                    continue
                self.log(f"section {name}")
                getattr(self, f"section_{name}")()
            self.result["status"] = "ok"
            return 0
        except Exception as e:  # noqa: BLE001 - the parent records it and goes on
            self.result["status"] = "error"
            self.result["error"] = f"{type(e).__name__}: {e}"
            self.result["traceback"] = traceback.format_exc()[-6000:]
            traceback.print_exc()
            return 1
        finally:
            self.save()


# -- the parent: sidecar, one child per configuration (warm start: several), tables ---------------


def run_child(
    args: argparse.Namespace, config: str, key: str, deadline: float, **child: Any
) -> dict[str, Any]:
    """One child process (`child`: more child-only flags), its result with its return code."""
    out = Path(args.out)
    result = out.with_name(f"{out.stem}.{key.replace('/', '.')}.part.json")
    result.unlink(missing_ok=True)
    argv = [sys.executable, str(Path(__file__).resolve()), *args.argv, "--child"]  # later win
    argv += ["--config", config, "--socket", args.socket, "--result", str(result)]
    argv += ["--deadline", f"{deadline - 5:.1f}", "--spawned", f"{time.time():.6f}"]
    for k, v in child.items():
        argv += [f"--{k}", str(v)]
    env = dict(os.environ, PYTHONHASHSEED=os.environ.get("PYTHONHASHSEED", "0"))
    print(f"== {key}: {deadline - time.time():.0f} s", flush=True)
    with open(args.log or out.with_suffix(".log"), "a") as log:
        log.write(f"\n===== {key} =====\n")
        log.flush()
        try:
            rc: int | str = subprocess.run(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=max(10.0, deadline - time.time() + 15),
                check=False,
            ).returncode
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
    tail = "" if rc == 0 else f" (rc {rc}: {run.get('error', 'see log')})"
    print(f"   {key}: {run.get('status')}{tail}", flush=True)
    return run


def run_sections(args: argparse.Namespace, report: dict[str, Any], t_end: float) -> None:
    """--rounds N: the configuration list N times over (A, B, A, B, ...), so machine drift hits
    every configuration alike; round r > 1 is stored as "config#r"."""
    order = [(r, c) for r in range(1, args.rounds + 1) for c in args.configs]
    for rnd, config in order:
        key = config if rnd == 1 else f"{config}#{rnd}"
        left = t_end - time.time()
        if left < CHILD_START_S:
            report["runs"][key] = {"config": config, "status": "skipped: out of time"}
            continue
        # the first engine of a fresh machine pays CUDA, model-cache and pinned-memory
        # warm-up (measured 67-115 s against 15-20 s later): give it that much more
        extra = args.first_start_s if (rnd, config) == order[0] else 0.0
        if args.cuda_graphs and rnd == 1:  # each configuration compiles on its first start
            extra += args.compile_s
        last = (rnd, config) == order[-1]
        deadline = t_end if last else time.time() + min(left, args.config_budget_s + extra)
        report["runs"][key] = {**run_child(args, config, key, deadline, round=rnd), "round": rnd}
        save(args, report)


def run_warm_start(args: argparse.Namespace, report: dict[str, Any], t_end: float, sidecar) -> None:
    """The warm-start plan (the module docstring): rounds of every configuration, each a
    fresh process; a kvo child is seeded first when the pool lacks the prompt."""
    children: list[dict[str, Any]] = report.setdefault("children", [])
    seeded: set[str] = set()
    failed: dict[str, str] = {}

    def child(config: str, role: str, tag: str = "") -> None:
        key = f"{config}/{role}" + (f"/{tag}" if tag else "") + f"#{len(children) + 1}"
        left = t_end - time.time()
        run: dict[str, Any] = {"config": config, "status": "skipped: out of time"}
        if config in failed:
            run["status"] = failed[config]
        elif left >= CHILD_START_S:
            extra = args.first_start_s if not children else 0.0
            deadline = time.time() + min(left, args.config_budget_s + extra)
            run = run_child(args, config, key, deadline, role=role)
        children.append({**run, "role": role, "tag": tag, "step": len(children) + 1})
        if role == "seed":
            seeded.add(config)
            if run["status"] != "ok":
                failed[config] = f"skipped: its seed failed ({run.get('error', run['status'])})"
        save(args, report)

    def measure(config: str, tag: str = "") -> None:
        kvo = config.startswith("kvo")
        need = next((c["stores"]["need_chunks"] for c in children if c.get("stores")), None)
        held = need is not None and pool_total(sidecar_stats(args.socket), "committedSlots") >= need
        if (kvo and not held) or (config not in seeded and config != "none"):
            child(config, "seed")
        child(config, "measure", tag)

    for rnd, order in enumerate(rotations(list(args.configs), args.reps)):
        for config in order:
            measure(config)
        kvo = next((c for c in args.configs if c.startswith("kvo")), None)
        if rnd == 0 and args.sidecar_restart and sidecar is not None and kvo:
            before, t0 = sidecar_stats(sidecar.socket), time.time()
            sidecar.kill()
            after = sidecar_stats(sidecar.start(timeout_s=120).socket)
            ev = {"event": "sidecar SIGKILLed and restarted", "serving_s": time.time() - t0}
            ev["committed_before"] = pool_total(before, "committedSlots")
            ev["committed_after"] = pool_total(after, "committedSlots")
            ev["generation_kept"] = before.get("poolGeneration") == after.get("poolGeneration")
            report.setdefault("events", []).append(ev | {"adoption": after.get("adoption")})
            measure(kvo, "sidecar")


def save(args: argparse.Namespace, report: dict[str, Any]) -> None:
    report["tables"] = tables(report)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))


def run_parent(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t_end = time.time() + args.budget_s
    shape = model_shape(Path(args.model))
    report: dict[str, Any] = {"bench": "e2e_gpu", "model": shape.name, "shape": asdict(shape)}
    # machine() asks nvidia-smi, not torch: a CUDA context here would hold GPU memory all run
    report |= {"machine": machine(), "argv": sys.argv[1:], "runs": {}}
    sidecar = None
    if any(c.startswith("kvo") for c in args.configs) and not args.socket:
        from kvoffload_cli.sidecar_child import SidecarProcess

        sidecar = SidecarProcess(f"{args.pool_gib}Gi", log_path=out.with_suffix(".sidecar.log"))
        sidecar.start(timeout_s=120)
        args.socket = sidecar.socket
    try:
        if "warm_start" in args.sections:
            run_warm_start(args, report, t_end, sidecar)
        else:
            run_sections(args, report, t_end)
    finally:
        if sidecar is not None:
            sidecar.close()
    save(args, report)
    print("\n".join(report["tables"]))
    return 0


# -- tables ------------------------------------------------------------------------------------


def _wall(samples: Iterable[dict[str, Any]]) -> list[float]:
    return [s["wall_ms"] for s in samples]


def tables(report: dict[str, Any]) -> list[str]:
    runs = report["runs"]
    shape = ModelShape(**report["shape"])
    gpu = ", ".join(report.get("machine", {}).get("gpu") or ["none"])
    lines = [f"model {report['model']}, GPU {gpu}; ms: median (min-max) of LLM.generate wall time"]
    configs = sorted(
        (n for n in runs if "#" not in n), key=lambda c: (CONFIGS.index(c.split("+")[0]), c)
    )
    ttft = {c: runs[c].get("sections", {}).get("ttft", {}).get("samples", {}) for c in configs}
    sizes = sorted({int(k.split("/")[0]) for s in ttft.values() for k in s})
    rows, notes = [], []
    for size in sizes:
        gpu_hits = [
            _wall(ttft[c][f"{size}/gpu_hit"])
            for c in configs
            if c.startswith("kvo") and ttft[c].get(f"{size}/gpu_hit")
        ]
        for phase in ("cold", "gpu_hit", "pool_hit"):
            row = {"prompt": f"{size:,}", "phase": phase}
            row |= {c: cell(_wall(ttft[c].get(f"{size}/{phase}", []))) for c in configs}
            if phase == "pool_hit" and gpu_hits:
                best = min(statistics.median(g) for g in gpu_hits)
                row["target"] = f"<= {pool_hit_target_ms(best, shape.kv_bytes(size)):.0f}"
            rows.append(row)
        for c in configs:
            if hits := ttft[c].get(f"{size}/pool_hit", []):
                cached = statistics.fmean(s["cached_tokens"] / s["prompt_tokens"] for s in hits)
                gpu = ttft[c].get(f"{size}/gpu_hit", [])
                pairs = [
                    (g["first_token"], h.get("first_token"))
                    for g, h in zip(gpu, hits, strict=False)
                    if g.get("first_token")
                ]
                same = (
                    f", first token as the GPU hit's {sum(g == h for g, h in pairs)}/{len(pairs)}"
                )
                notes.append(f"{c} {size}: {cached:.0%} not recomputed" + (same if pairs else ""))
    if rows:
        lines += [table(rows), "pool hits: " + "; ".join(notes)]
    mt_rows = []
    for c in configs:
        sec = runs[c].get("sections", {}).get("multiturn")
        if not sec or not sec.get("rounds"):
            continue
        rounds = sec["rounds"]
        wall = sum(r["wall_s"] for r in rounds)
        toks = sum(r["prompt_tokens"] + r["generated_tokens"] for r in rounds)
        ttfts = [t for r in rounds for t in r["ttft_ms"]]
        cached = sum(r["cached_tokens"] for r in rounds) / max(
            1, sum(r["prompt_tokens"] for r in rounds)
        )
        mt_rows.append({
            "multi-turn": c + ("" if sec.get("complete") else f" ({len(rounds)} rounds)"),
            "wall s": round(wall, 1), "tok/s": round(toks / wall),
            "TTFT mean ms": round(statistics.fmean(ttfts)) if ttfts else "-",
            "TTFT p99 ms": round(percentile(ttfts, 99)) if ttfts else "-",
            "cached": f"{cached:.0%}",
            "preemptions": sum(v for k, v in sec.get("counters", {}).items() if "preempt" in k),
        })  # fmt: skip
    if mt_rows:
        lines.append(table(mt_rows))
    lines += warm_start_table(report, shape)
    named = [*runs.items(), *((f"step {c['step']}", c) for c in report.get("children", []))]
    bad = [f"{k}: {r['status']} {r.get('error', '')}" for k, r in named if r["status"] != "ok"]
    return lines + (["not ok: " + "; ".join(bad)] if bad else [])


def warm_start_table(report: dict[str, Any], shape: ModelShape) -> list[str]:
    """Per scenario (a configuration's restarts; after the sidecar's restart apart): the first
    request's TTFT, hit and spawn -> first token, and the GPU hit after it."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for c in report.get("children", []):
        if c.get("requests") and c["role"] == "measure":
            name = c["config"] + (" (vLLM and the sidecar restarted)" if c["tag"] else "")
            groups.setdefault(name, []).append(c)
    if not groups:
        return []

    def of(runs: list[dict[str, Any]], name: str, key: str) -> list[float]:
        return [q[key] for r in runs for q in r["requests"] if q["name"] == name]

    rows = [
        {
            "scenario": name,
            "n": len(runs),
            "first TTFT ms": cell(of(runs, "first", "wall_ms")),
            "first hit": f"{statistics.median(of(runs, 'first', 'hit')):.0%}",
            "spawn->token s": cell(of(runs, "first", "done_s"), 1),
            "GPU hit ms": cell(of(runs, "gpu_hit", "wall_ms")),
        }
        for name, runs in groups.items()
    ]
    tokens = next(q["prompt_tokens"] for r in groups.values() for q in r[0]["requests"])
    kv = shape.kv_bytes(tokens)
    gpu = [q for r in groups.values() for q in of(r, "gpu_hit", "wall_ms")]
    floor = statistics.median(gpu) + kv / (PCIE_GBPS * 1e9) * 1e3 if gpu else math.nan
    return [
        table(rows),
        f"{tokens:,}-token prompt, KV {kv / 1e9:.2f} GB; floor for a pool hit: GPU hit + the "
        f"bytes at {PCIE_GBPS:.0f} GB/s = {floor:.0f} ms",
        *(f"sidecar restart: {ev}" for ev in report.get("events", [])),
    ]


# -- command line ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = p.add_argument
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    add("--model", default=str(ROOT / "bench/e2e_models/llama3-8b"))
    add("--configs", default=",".join(CONFIGS), type=lambda s: parse_list(s, CONFIGS, "configs"))
    sections = lambda s: parse_list(s, SECTIONS, "sections")  # noqa: E731
    add("--sections", default="ttft,multiturn", type=sections)
    add("--sizes", default="2000,10000,32000", type=ints, help="prompt lengths")
    add("--reps", type=int, default=4, help="prompts per size (warm start: rounds)")
    add("--out", default=str(ROOT / "bench/out/e2e_gpu.json"))
    add("--log", default="", help="engines' output (default: OUT with .log)")
    add("--budget-s", type=float, default=540, help="wall budget of the whole run")
    add("--rounds", type=int, default=1, help="run the configuration list this many times over")
    add("--config-budget-s", type=float, default=200, help="cap per child (the last: the rest)")
    add("--socket", default="", help="a running sidecar's socket (else one is started)")
    add("--pool-gib", type=int, default=40, help="pool size of a started sidecar")
    add("--cpu-gib", type=float, default=40, help="vLLM connectors' CPU capacity")
    add("--max-model-len", type=int, default=40960)
    add("--gpu-blocks", type=int, default=5000, help="num_gpu_blocks_override (0: vLLM sizes it)")
    add("--gpu-mem-util", type=float, default=0.9)
    add("--dtype", default="bfloat16")
    add("--kvo-chunk", type=int, default=0, help="kvoffload chunk_size (0: default)")
    add("--block-size", type=int, default=0, help="0: vLLM's default (16 on CUDA)")
    add("--filler-tokens", type=int, default=30000)
    add(
        "--fillers",
        type=int,
        default=0,
        help="filler prompts per flush (0: enough for 1.1 x the GPU cache; a hybrid model "
        "cycles every KV group's blocks, so fewer suffice there)",
    )
    add("--first-start-s", type=float, default=60, help="extra seconds for the first child")
    add("--cuda-graphs", action="store_true", help="vLLM's compile and CUDA graphs (not eager)")
    add("--compile-s", type=float, default=45, help="--cuda-graphs: a configuration's first start")
    add("--settle-s", type=float, default=0.25, help="pause before each timed request")
    add("--stall-s", type=float, default=45, help="a generate() this long is a hang")
    add("--reserve-s", type=float, default=8, help="time kept for shutdown")
    add("--mt-convs", type=int, default=64)
    add("--mt-system", type=int, default=8192)
    add("--mt-turn", type=int, default=500)
    add("--mt-reply", type=int, default=32)
    add("--mt-turns", type=int, default=4)
    add("--sidecar-restart", action="store_true", help="warm start: after round 1 (docstring)")
    add("--store-wait-s", type=float, default=60, help="warm start: a seed's wait for commits")
    # child-only
    add("--child", action="store_true", help=argparse.SUPPRESS)
    add("--config", default="none", help=argparse.SUPPRESS)
    add("--role", default="", help=argparse.SUPPRESS)
    add("--result", default="", help=argparse.SUPPRESS)
    add("--round", type=int, default=1, help=argparse.SUPPRESS)
    add("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    add("--spawned", type=float, default=0.0, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.reps < 1 or not args.sizes or min(args.sizes) < 16:
        raise SystemExit("--reps must be >= 1 and every --sizes entry >= 16 tokens")
    fillers = args.filler_tokens if "ttft" in args.sections else 0
    if max(args.sizes) >= args.max_model_len or fillers >= args.max_model_len:
        raise SystemExit("--sizes and --filler-tokens must stay below --max-model-len")
    if "warm_start" in args.sections and len(args.sections) > 1:
        raise SystemExit("--sections warm_start runs alone")
    if args.child:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        args.spawned = args.spawned or time.time()
        args.deadline = args.deadline or time.time() + args.budget_s
        rc = Child(args).run()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)  # no engine shutdown: its result is saved (a restart is a process ending)
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
