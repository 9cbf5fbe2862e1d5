"""Real serving under load: `vllm serve` per configuration, vLLM's clients, a rate sweep.

For each configuration (in the order given: rotate it between calls) this starts vLLM's
OpenAI-compatible server (`vllm serve`, dummy weights, the served model folder of
`bench/serve_model.py`), waits for /health, then drives it with clients others use:

    random   `vllm bench serve --dataset-name random`: nothing repeats, 0% hits (the cost of
             offloading when it cannot help), at --random-rates
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
sets that server's sidecar pool size instead of --cpu-gib. `#N` after a
configuration names one more server of it (`none#2`): serve_paired.py starts A B B A in one call.
Per configuration and point: request and output-token throughput, TTFT and TPOT p50/p99 (the
client's), and from the server's /metrics before and after the point: GPU prefix-cache hit rate,
host-tier (external) hit rate, preemptions. The JSON is rewritten after every point; tables are
printed last. `bench/serve_report.py` merges calls (spread) and draws the plots.

    python -m bench serve_sweep --configs none,offloading,simple,kvo-eager,kvo-lazy \
        --rates 2,4,8,16,32 --out bench/out/serve/call1.json
`bash bench/gpu_run.sh serve_sweep BUDGET_S [flags]` runs it on the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_gpu import kv_transfer_config as e2e_kv_transfer_config  # noqa: E402
from harness import machine, table  # noqa: E402
from serve_model import build_model_dir  # noqa: E402

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
    """`vllm ARGS...` through this interpreter (the GPU machine's vLLM is a folder, not a wheel)."""
    return [sys.executable, str(ROOT / "bench" / "vllm_cli.py"), *args]


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
        argv = vllm_cli(
            "serve",
            str(self.model_dir),
            "--served-model-name",
            SERVED_NAME,
            "--port",
            str(self.port),
            "--host",
            "127.0.0.1",
            "--load-format",
            "dummy",
            "--dtype",
            a.dtype,
            "--seed",
            "0",
            "--max-model-len",
            str(a.max_model_len),
            "--num-gpu-blocks-override",
            str(a.gpu_blocks),
            "--gpu-memory-utilization",
            str(a.gpu_mem_util),
            "--enable-prefix-caching",
            "--tensor-parallel-size",
            str(a.tp),
        )
        if a.graphs == "decode":  # CUDA graphs for decode, no torch.compile: starts in seconds
            argv += [
                "--compilation-config",
                json.dumps(
                    {
                        "mode": 0,
                        "cudagraph_mode": "FULL_DECODE_ONLY",
                        "max_cudagraph_capture_size": a.max_graph_batch,
                    }
                ),
            ]
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
    argv = vllm_cli(
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        server.url,
        "--endpoint",
        "/v1/completions",
        "--model",
        SERVED_NAME,
        "--tokenizer",
        str(server.model_dir),
        "--num-prompts",
        str(point.requests),
        "--request-rate",
        "inf" if math.isinf(point.rate) else f"{point.rate:g}",
        "--seed",
        str(point.seed),
        "--ignore-eos",
        "--temperature",
        "0",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result.parent),
        "--result-filename",
        result.name,
        "--dataset-name",
        point.workload if point.workload == "random" else "prefix_repetition",
    )
    if point.workload == "random":
        argv += [
            "--random-input-len",
            str(a.random_input_len),
            "--random-output-len",
            str(a.output_len),
            "--random-range-ratio",
            "0",
        ]
    else:
        argv += [
            "--prefix-repetition-prefix-len",
            str(a.prefix_len),
            "--prefix-repetition-suffix-len",
            str(a.suffix_len),
            "--prefix-repetition-num-prefixes",
            str(a.num_prefixes),
            "--prefix-repetition-output-len",
            str(a.output_len),
        ]
    return argv


def chat_argv(a: argparse.Namespace, server: Server, point: Point, result: Path) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "bench" / "serve_chat.py"),
        "--base-url",
        server.url,
        "--model",
        SERVED_NAME,
        "--clients",
        str(int(point.rate)),
        "--conversations",
        str(a.chat_conversations),
        "--turns",
        str(a.chat_turns),
        "--system-tokens",
        str(a.chat_system_tokens),
        "--first-user-tokens",
        str(a.chat_first_user_tokens),
        "--user-tokens",
        str(a.chat_user_tokens),
        "--reply-tokens",
        str(a.chat_reply_tokens),
        "--think-s",
        str(a.chat_think_s),
        "--seed",
        str(point.seed),
        "--timeout-s",
        str(a.chat_timeout_s),
        "--out",
        str(result),
    ]


RESULT_KEYS = (
    "completed",
    "failed",
    "duration",
    "request_throughput",
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
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


def floats(text: str) -> list[float]:
    return [float(t) for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    report = sweep(a)
    failed = [c for c, s in report["servers"].items() if s.get("status") != "ok"]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
