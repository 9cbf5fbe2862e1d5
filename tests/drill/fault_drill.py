"""The fault drill: a real vLLM engine keeps serving while its sidecar is SIGKILLed.

One vLLM engine driven from this process (`LLM.llm_engine`, fed with `add_request`/`step`) with
the kvoffload connector serves a steady stream of requests: K documents of a few pool chunks
each, every request one document + a distinct suffix (one chunk and a tail, so every request
stores a new chunk) and a few greedy tokens, several requests in flight. A GPU KV cache smaller
than the documents (`num_gpu_blocks_override`) makes GPU prefix-cache misses happen, so the
pool serves loads.

A killer thread SIGKILLs the real `kvoffload sidecar` at random moments (seeded RNG: a random
delay after the connector registered again, so kills land while stores and loads are in
flight) and restarts it at once with the same command line (same --pool-dir, --pool-size,
--socket), --kills times. Just before each kill it reads the sidecar's Stats (committed,
reserved, pinned slots: what was in flight); after the restart it polls Stats until the new
sidecar answers (kill -> serving), reads `Stats.adoption` (what it kept of the pool file) and
polls `namespaces[].live_clients` until the connector's clients are back (kill -> registered).

Load: without --rate the engine is kept full (--inflight requests); with it, waves of --inflight
requests start at most --rate requests a second. vLLM's engine processes run at --engine-nice.

Phases: warm-up (no kills), a "before" probe (GPU prefix cache reset, one request per document
one at a time: every cached token is a pool hit), the kill phase, an "after" probe right after
the last restart (with adoption the documents hit again; without, they miss). Then the engine
is shut down and the same requests run through an engine without kvoffload in a child process
(this script, --reference-server: a clean process is robust on GPU and CPU alike) and every output
is compared token by token. Exit status 1 when a request failed, a token differs, or fewer
than --kills kills fit in --budget-s.

    python tests/drill/fault_drill.py [--model DIR] [--kills 200] [--seed 0] [--out JSON]
        [--block-size N] [--chunk N] [--gpu-memory-utilization F] [--max-model-len N]
        [--device-agnostic] ...

On the GPU machine `bash bench/gpu_run.sh fault_drill [BUDGET_S]` runs it (vLLM 0.26;
bench/gpu_run.sh's PYTHONPATH, VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine lives in this
process, so it and the reference get --gpu-memory-utilization 0.4). test_fault_drill.py beside
this runs it in CI; chaos_drill.py beside this runs on its Sidecar, Drill and Reference, and
tests/connector/tp_check.py on its engine arguments.

Engine arguments: every platform gets the same ones (dummy weights, token-id prompts,
`num_gpu_blocks_override`); on a CPU build `kv_cache_memory_bytes` (--kv-bytes), on a GPU
`gpu_memory_utilization`. --device-agnostic passes neither unless given: vLLM's own defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
try:
    import kvoffload_connector  # noqa: F401
except ImportError:  # a checkout without `pip install -e .` (the GPU machine's image)
    sys.path[:0] = [str(ROOT / p) for p in ("connector", "sidecar", "protos/gen", "cli")]

sys.path.append(str(ROOT))  # tests.vllm_zygote

from harness import report, spread  # noqa: E402
from kvoffload_cli.sidecar_child import stop_process  # noqa: E402

from tests import vllm_zygote  # noqa: E402

DEFAULT_MODEL = ROOT / "tests" / "connector" / "models" / "tiny-llama"


# -- requests -----------------------------------------------------------------------------


@dataclass
class Workload:
    """K documents of `doc_chunks` pool chunks; request i = document + a distinct suffix.
    `hot` > 0 skews the choice of document: document d weighs 1 / (d + 1) ** hot (a few hot
    documents hit while the rest pass through the pool); 0 picks uniformly."""

    seed: int
    docs: int
    doc_chunks: int
    chunk_tokens: int
    vocab: int
    suffix_tokens: int
    hot: float = 0.0
    documents: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        rng = random.Random(f"docs-{self.seed}")
        n = self.doc_chunks * self.chunk_tokens
        self.documents = [self._tokens(rng, n) for _ in range(self.docs)]

    def _tokens(self, rng: random.Random, n: int) -> list[int]:
        # ids >= 3 stay clear of the special ids; a small range keeps dummy models' logits sane
        hi = max(4, min(self.vocab, 32000)) - 1
        return [rng.randint(3, hi) for _ in range(n)]

    def request(self, i: int, doc: int | None = None) -> tuple[int, list[int]]:
        rng = random.Random(f"req-{self.seed}-{i}")
        if doc is not None:
            d = doc
        elif self.hot > 0:
            weights = [1 / (k + 1) ** self.hot for k in range(self.docs)]
            d = rng.choices(range(self.docs), weights)[0]
        else:
            d = rng.randrange(self.docs)
        return d, self.documents[d] + self._tokens(rng, self.suffix_tokens)


# -- the sidecar, supervised --------------------------------------------------------------


class Sidecar:
    """A real `kvoffload sidecar` restarted with the same command line after every kill."""

    def __init__(
        self, cmd: list[str], socket: str, log_path: Path, env: dict[str, str] | None = None
    ):
        self.cmd, self.socket, self.log_path = cmd, socket, log_path
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.frozen = False

    def spawn(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.env,
            )

    def stats(self, timeout_s: float = 1.0):
        """One Stats call on a fresh channel (a kept channel would sit in gRPC's reconnect
        backoff after a kill); None when nothing answers."""
        import grpc
        from kvoffload.v1 import pool_pb2, pool_pb2_grpc

        try:
            with grpc.insecure_channel(f"unix://{self.socket}") as ch:
                return pool_pb2_grpc.KVPoolStub(ch).Stats(
                    pool_pb2.StatsRequest(), timeout=timeout_s
                )
        except grpc.RpcError:
            return None

    def wait_serving(self, deadline_s: float, poll_s: float = 0.005):
        """Polls Stats until the sidecar answers: (monotonic time, Stats) or (None, None)."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.proc is not None and self.proc.poll() is not None:
                return None, None
            if os.path.exists(self.socket):
                st = self.stats(timeout_s=0.5)
                if st is not None:
                    return time.monotonic(), st
            time.sleep(poll_s)
        return None, None

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.frozen = False

    def freeze(self, max_s: float = 5.0) -> None:
        """SIGSTOP, then wait until the kernel shows the process stopped (the signal is
        delivered asynchronously: an answer may still leave just after it was sent)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.frozen = True
        end = time.monotonic() + max_s
        while time.monotonic() < end and process_state(self.proc.pid) not in ("T", "t"):
            time.sleep(0.002)

    def thaw(self) -> None:
        if self.proc is not None and self.frozen:
            self.proc.send_signal(signal.SIGCONT)
        self.frozen = False

    def stop(self) -> None:
        if self.proc is not None:
            self.thaw()  # a stopped process would hold its SIGTERM until the timeout
            stop_process(self.proc)


def process_state(pid: int) -> str:
    """The state letter of /proc/<pid>/stat ("T": stopped); "" when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat[stat.rindex(")") + 2 :][:1]


def slots(st) -> dict[str, int]:
    """Committed/reserved/pinned/withheld slots and live clients over every namespace of a
    Stats."""
    keys = ("committed", "reserved", "pinned", "live", "hit", "stored", "loaded", "evicted")
    out = dict.fromkeys((*keys, "withheld"), 0)
    for ns in st.namespaces:
        out["withheld"] += ns.withheld_slots  # reserved under the last instance, still out
        out["committed"] += ns.committed_slots
        out["reserved"] += ns.reserved_slots
        out["pinned"] += ns.pinned_slots
        out["live"] += ns.live_clients
        out["hit"] += ns.hit_blocks
        out["stored"] += ns.stored_blocks
        out["loaded"] += ns.loaded_blocks
        out["evicted"] += ns.evicted_blocks
    return out


# -- the killer ---------------------------------------------------------------------------


class Killer(threading.Thread):
    """SIGKILLs the sidecar `kills` times at random moments, restarts it, times the recovery."""

    def __init__(self, sidecar: Sidecar, args: argparse.Namespace, clients: int):
        super().__init__(name="killer", daemon=True)
        self.sidecar, self.args, self.clients = sidecar, args, clients
        self.rng = random.Random(f"kills-{args.seed}")
        self.records: list[dict[str, Any]] = []
        self.stop_event = threading.Event()
        self.done = threading.Event()
        self.error = ""

    def wait_registered(self, since: float) -> tuple[float | None, float | None]:
        """Seconds from `since` until the first, and until all, of the connector's clients
        registered with the (new) sidecar; None where it did not happen in --register-s."""
        first = every = None
        end = time.monotonic() + self.args.register_s
        while time.monotonic() < end and not self.stop_event.is_set():
            st = self.sidecar.stats(timeout_s=0.5)
            if st is not None:
                live = slots(st)["live"]
                now = time.monotonic()
                if live >= 1 and first is None:
                    first = now - since
                if live >= self.clients:
                    every = now - since
                    break
            time.sleep(0.01)
        return first, every

    def run(self) -> None:
        try:
            self._run()
        except Exception as e:  # noqa: BLE001 - the report says what stopped the drill
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.done.set()

    def _run(self) -> None:
        lo, hi = self.args.kill_delay
        start = time.monotonic()
        for k in range(self.args.kills):
            if self.stop_event.is_set() or time.monotonic() - start > self.args.budget_s:
                break
            if self.stop_event.wait(self.rng.uniform(lo, hi)):
                break
            st = None
            for _ in range(3):  # a loaded box may answer one Stats late: each kill is measured
                st = self.sidecar.stats(timeout_s=1.0)
                if st is not None:
                    break
            before = slots(st) if st is not None else {}
            t_kill, wall_kill = time.monotonic(), time.time()
            self.sidecar.kill()
            rec: dict[str, Any] = {
                "kill": k,
                "t": round(t_kill - start, 3),
                "wall": wall_kill,
                "before": before,
                "generation_before": st.pool_generation if st is not None else "",
            }
            self.sidecar.spawn()
            t_up, st2 = self.sidecar.wait_serving(self.args.serve_s)
            if t_up is None:
                rec["serve_s"] = None
                self.records.append(rec)
                raise RuntimeError(f"the restarted sidecar did not serve: {self.log_tail()}")
            a = st2.adoption
            rec.update(
                serve_s=t_up - t_kill,
                generation_after=st2.pool_generation,
                adoption={
                    "outcome": a.outcome,
                    "reason": a.reason,
                    "adopted_blocks": a.adopted_blocks,
                    "adopted_namespaces": a.adopted_namespaces,
                    "discarded_blocks": dict(a.discarded_blocks),
                    "adopt_seconds": a.adopt_seconds,
                    "boots": a.boots,
                },
            )
            committed = before.get("committed")
            rec["survived"] = a.adopted_blocks / committed if committed else None
            first, every = self.wait_registered(t_kill)
            rec["register_first_s"], rec["register_s"] = first, every
            self.records.append(rec)

    def log_tail(self) -> str:
        try:
            return self.sidecar.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return ""


# -- the engine ---------------------------------------------------------------------------


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """What the drill's engine and the reference engine share (all but the connector)."""
    kw: dict[str, Any] = {
        "model": args.model,
        "load_format": args.load_format,
        "skip_tokenizer_init": True,
        "seed": 0,
        "max_model_len": args.max_model_len,
        "max_num_seqs": getattr(args, "max_num_seqs", 0) or max(8, args.inflight),
        "num_gpu_blocks_override": args.gpu_blocks,
        "enforce_eager": not args.cuda_graphs,
        "enable_prefix_caching": True,
        "disable_log_stats": False,
    }
    if args.block_size:
        kw["block_size"] = args.block_size
    if args.dtype:
        kw["dtype"] = args.dtype
    if args.tp > 1:
        kw["tensor_parallel_size"] = args.tp
    cpu = False
    if not args.device_agnostic:
        from vllm.platforms import current_platform

        cpu = current_platform.is_cpu()
    if args.kv_bytes or cpu:
        kw["kv_cache_memory_bytes"] = args.kv_bytes or (256 << 20)
    if args.gpu_memory_utilization or not (cpu or args.device_agnostic):
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization or 0.9
    return kw


def kv_transfer_config(args: argparse.Namespace) -> dict[str, Any]:
    """As the injector configures it (recompute on a failed load), plus --extra-config."""
    extra: dict[str, Any] = {"socket": args.socket}
    if args.chunk:
        extra["chunk_size"] = args.chunk
    extra.update(args.extra_config or {})
    return {
        "kv_connector": "KVOffloadConnector",
        "kv_connector_module_path": "kvoffload_connector.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def connector_counters() -> dict[str, float]:
    """The connector's Prometheus counters in this process (vLLM's offline stat loggers)."""
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        if family.name.startswith("kvoffload_connector"):
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    name = sample.name.removeprefix("kvoffload_connector_")
                    name = name.removesuffix("_total")
                    out[name] = out.get(name, 0.0) + sample.value
    return out


class Drill:
    """The engine loop: keeps --inflight requests in the engine, records every output."""

    def __init__(self, llm, args: argparse.Namespace, work: Workload):
        from vllm import SamplingParams

        self.llm, self.engine, self.args, self.work = llm, llm.llm_engine, args, work
        self.sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        self.requests: list[dict[str, Any]] = []  # index = request number
        self.inflight: set[str] = set()
        self.phase = "warmup"
        self.last_progress = time.monotonic()

    def add(self, doc: int | None = None, priority: int = 0) -> None:
        """Request i; `priority` > 0 waits behind the others (vLLM's priority policy)."""
        i = len(self.requests)
        d, prompt = self.work.request(i, doc)
        rid = f"r{i}"
        self.requests.append(
            {
                "i": i,
                "doc": d,
                "phase": self.phase,
                "prompt": prompt,
                "tokens": None,
                "t_add": time.monotonic(),
                "priority": priority,
            }
        )
        more = {"priority": priority} if priority else {}
        self.engine.add_request(rid, {"prompt_token_ids": prompt}, self.sp, **more)
        self.inflight.add(rid)

    def step(self) -> None:
        for o in self.engine.step():
            self.last_progress = time.monotonic()
            rec = self.requests[int(o.request_id[1:])]
            if "ttft_s" not in rec and o.outputs and o.outputs[0].token_ids:
                rec["ttft_s"] = self.last_progress - rec["t_add"]  # queued + prefill (+ load)
            if not o.finished:
                continue
            self.inflight.discard(o.request_id)
            c = o.outputs[0] if o.outputs else None
            rec["tokens"] = list(c.token_ids) if c is not None else []
            rec["finish"] = str(c.finish_reason) if c is not None else "none"
            rec["cached"] = int(o.num_cached_tokens or 0)
        self.last_progress = time.monotonic()

    def stream(self, more) -> None:
        """Keeps requests coming while `more()`, then drains the engine. Without --rate the
        engine stays full (--inflight requests); with it, waves of --inflight requests start
        at most --rate requests a second (each wave once the last one finished)."""
        wave_s = self.args.inflight / self.args.rate if self.args.rate else 0.0
        next_wave = time.monotonic()
        while True:
            feeding = more()
            if feeding and not wave_s:
                while len(self.inflight) < self.args.inflight:
                    self.add()
            elif feeding and not self.inflight:
                now = time.monotonic()
                if now < next_wave:
                    self.last_progress = now
                    time.sleep(min(next_wave - now, 0.05))
                    continue
                for _ in range(self.args.inflight):
                    self.add()
                next_wave = max(next_wave + wave_s, now)
            if not self.inflight:
                if not feeding:
                    return
                continue
            self.step()

    def probe(self, phase: str) -> dict[str, Any]:
        """GPU prefix cache emptied, then one request per document, one at a time: its cached
        tokens can only come from the pool."""
        self.phase = phase
        reset = bool(self.llm.reset_prefix_cache())
        hits = []
        for d in range(self.work.docs):
            self.add(doc=d)
            while self.inflight:
                self.step()
            hits.append(self.requests[-1]["cached"])
        doc_tokens = self.work.doc_chunks * self.work.chunk_tokens
        return {
            "gpu_cache_reset": reset,
            "hit_tokens": sum(hits),
            "doc_tokens": doc_tokens * self.work.docs,
            "hit_fraction": sum(hits) / (doc_tokens * self.work.docs),
            "docs_hit": sum(1 for h in hits if h > 0),
            "per_doc": hits,
        }


def renice_engine(nice: int, keep: set[int]) -> list[int]:
    """Every thread of this process's child processes (vLLM's engine core and workers; not the
    sidecar, `keep`) at nice `nice`: on a 2-core box vLLM's busy processes would otherwise
    delay the killer thread's timing and the sidecar restarts (where the kernel groups tasks by
    session, the sidecar, a session of its own, competes as a group anyway). Linux nice is
    per thread, so each task of each process. Returns the pids reniced."""
    import psutil

    done = []
    for child in psutil.Process().children(recursive=True):
        if child.pid in keep:
            continue
        try:
            for tid in os.listdir(f"/proc/{child.pid}/task"):
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
            done.append(child.pid)
        except (OSError, psutil.Error):
            continue
    return done


def settle(sidecar: Sidecar, max_s: float = 10.0) -> None:
    """Until no store reservation is open (the last stores committed); at most `max_s`."""
    end = time.monotonic() + max_s
    while time.monotonic() < end:
        st = sidecar.stats()
        if st is not None and slots(st)["reserved"] == 0:
            return
        time.sleep(0.05)


def watchdog(drill: Drill, stall_s: float, on_stall) -> None:
    """A step that never returns is a hang: dump every thread's stack and stop the run."""

    def loop() -> None:
        while True:
            time.sleep(1.0)
            if time.monotonic() - drill.last_progress > stall_s:
                faulthandler.dump_traceback(all_threads=True)
                on_stall()
                os._exit(3)

    threading.Thread(target=loop, name="watchdog", daemon=True).start()


# -- reference ----------------------------------------------------------------------------


class Reference:
    """The engine without kvoffload in a child process (this script, --reference-server; a
    clean process is robust on GPU and CPU alike), then given every prompt in one batch. The
    chaos drill starts it at once (it loads while the drill's engine does); this drill once
    its own engine is gone (one engine at a time)."""

    def __init__(self, kwargs: dict[str, Any], work_dir: Path, max_tokens: int):
        self.dir = work_dir
        self.ready = work_dir / "reference.ready"
        self.log = work_dir / "reference.log"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--reference-server"]
        cmd += [json.dumps({"kwargs": kwargs, "max_tokens": max_tokens, "dir": str(work_dir)})]
        # its own port range: two engines starting together could pick one port with bind(0);
        # its engine core and worker in its own process (a third of the start of three)
        env = dict(os.environ, VLLM_PORT=str(random.randrange(20000, 29000, 16)))
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        with open(self.log, "ab") as log:
            self.proc = vllm_zygote.popen(  # the drill's zygote where it has one
                cmd,
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def generate(self, prompts: list[list[int]], timeout_s: float) -> list[list[int]]:
        end = time.monotonic() + timeout_s
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"the reference engine did not start:\n{self.tail()}")
            time.sleep(0.1)
        (self.dir / "reference-in.json").write_text(json.dumps(prompts))
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.close()
        try:
            self.proc.wait(max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the reference engine did not finish:\n{self.tail()}") from None
        out = self.dir / "reference-out.json"
        if self.proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"reference engine failed ({self.proc.returncode}):\n{self.tail()}")
        return json.loads(out.read_text())

    def tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def reference_server(spec: str) -> int:
    """Child mode: an engine without kvoffload; once told on stdin, every prompt of
    reference-in.json, greedy, tokens to reference-out.json."""
    from vllm import LLM, SamplingParams

    cfg = json.loads(spec)
    work = Path(cfg["dir"])
    llm = LLM(**cfg["kwargs"])
    (work / "reference.ready").write_text("1")
    if sys.stdin.readline().strip() != "go":
        return 1
    prompts = json.loads((work / "reference-in.json").read_text())
    sp = SamplingParams(temperature=0.0, max_tokens=cfg["max_tokens"], ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    (work / "reference-out.json").write_text(json.dumps(tokens))
    return 0


# -- main ---------------------------------------------------------------------------------


def sidecar_command(args: argparse.Namespace, pool_dir: Path) -> list[str]:
    from kvoffload_cli.sidecar_child import kvoffload_command

    return [
        *kvoffload_command(),
        "sidecar",
        "--pool-size",
        args.pool_size,
        "--pool-dir",
        str(pool_dir),
        "--socket",
        args.socket,
        "--detach-grace",
        str(args.detach_grace),
        *args.sidecar_arg,
    ]


def chunk_tokens(llm, configured: int) -> int:
    from kvoffload_connector.common.config import default_chunk_tokens

    block = int(llm.llm_engine.vllm_config.cache_config.block_size)
    return -(-configured // block) * block if configured else default_chunk_tokens(block)


def summarize(
    args: argparse.Namespace,
    drill: Drill | None,
    killer: Killer | None,
    ref: dict | None,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """The JSON's numbers: requests (served, failed, compared with the reference), kills (what
    was in flight, adoption, recovery times), plus `extra` (probes, counters, engine)."""
    reqs = drill.requests if drill else []
    served = [r for r in reqs if r["tokens"] is not None]
    failed = [
        r
        for r in reqs
        if r["tokens"] is None or r.get("finish") != "length" or len(r["tokens"]) != args.max_tokens
    ]
    differing_tokens = differing_requests = 0
    compared = 0
    if ref is not None:
        for r, want in zip(reqs, ref["tokens"], strict=True):
            if r["tokens"] is None:
                continue
            compared += 1
            got = r["tokens"]
            diff = sum(1 for a, b in zip(got, want, strict=False) if a != b)
            diff += abs(len(got) - len(want))
            differing_tokens += diff
            differing_requests += 1 if diff else 0
    kills = killer.records if killer else []
    survived = [k["survived"] for k in kills if k.get("survived") is not None]
    serve = [k["serve_s"] for k in kills if k.get("serve_s") is not None]
    reg_first = [k["register_first_s"] for k in kills if k.get("register_first_s") is not None]
    reg_all = [k["register_s"] for k in kills if k.get("register_s") is not None]
    outcomes = Counter(k.get("adoption", {}).get("outcome", "?") or "(none)" for k in kills)
    stores = sum(1 for k in kills if k["before"].get("reserved", 0) > 0)
    loads = sum(1 for k in kills if k["before"].get("pinned", 0) > 0)
    both = sum(
        1 for k in kills if k["before"].get("reserved", 0) > 0 and k["before"].get("pinned", 0) > 0
    )
    idle = sum(
        1
        for k in kills
        if k["before"] and not (k["before"].get("reserved") or k["before"].get("pinned"))
    )
    first_gen = extra.get("generation", "")
    same_gen = sum(1 for k in kills if first_gen and k.get("generation_after") == first_gen)
    by_phase = Counter(r["phase"] for r in served)
    summary = {
        "kills": len(kills),
        "kills_with_stores_in_flight": stores,
        "kills_with_loads_in_flight": loads,
        "kills_with_both": both,
        "kills_idle": idle,
        "requests": len(reqs),
        "requests_served": len(served),
        "requests_by_phase": dict(by_phase),
        "requests_failed": len(failed),
        "requests_compared": compared,
        "differing_tokens": differing_tokens if ref is not None else None,
        "differing_requests": differing_requests if ref is not None else None,
        "adoption_outcomes": dict(outcomes),
        "generation_kept": same_gen,
        "survived": spread(survived),
        "serve_s": spread(serve),
        "register_first_s": spread(reg_first),
        "register_s": spread(reg_all),
        "never_registered": sum(1 for k in kills if k.get("register_s") is None),
        **extra,
    }
    if len(kills) < args.kills and not extra.get("error"):
        extra["error"] = f"{len(kills)} of {args.kills} kills within --budget-s {args.budget_s:g}"
        summary["error"] = extra["error"]
    summary["ok"] = (
        summary["requests_failed"] == 0
        and ref is not None
        and differing_tokens == 0
        and not extra.get("error")
    )
    summary["failed_examples"] = [
        {k: r.get(k) for k in ("i", "phase", "finish", "tokens")} for r in failed[:5]
    ]
    return summary


def rows_of(s: dict[str, Any]) -> list[dict[str, Any]]:
    def spread_row(name: str, sp: dict[str, float], unit: str) -> dict[str, Any]:
        return {
            "measure": name,
            "value": sp["n"],
            "p50": sp["p50"],
            "p99": sp["p99"],
            "min": sp["min"],
            "max": sp["max"],
            "unit": unit,
        }

    pb, pa = s.get("probe_before", {}), s.get("probe_after", {})
    hits = s.get("connector_hit_tokens", {})
    return [
        {"measure": "kills (SIGKILL + restart)", "value": s["kills"]},
        {
            "measure": "  with stores in flight (reserved > 0)",
            "value": s["kills_with_stores_in_flight"],
        },
        {
            "measure": "  with loads in flight (pinned > 0)",
            "value": s["kills_with_loads_in_flight"],
        },
        {"measure": "  with nothing in flight", "value": s["kills_idle"]},
        {"measure": "requests served", "value": s["requests_served"]},
        {"measure": "requests failed", "value": s["requests_failed"]},
        {"measure": "tokens that differ from the reference", "value": s["differing_tokens"]},
        {"measure": "adoption outcomes", "value": json.dumps(s["adoption_outcomes"])},
        {"measure": "restarts that kept the pool generation", "value": s["generation_kept"]},
        spread_row("committed blocks surviving a restart", s["survived"], "fraction"),
        spread_row("kill -> restarted sidecar answers Stats", s["serve_s"], "s"),
        spread_row("kill -> first connector client registered", s["register_first_s"], "s"),
        spread_row("kill -> all connector clients registered", s["register_s"], "s"),
        {
            "measure": "pool hits, probe before kills",
            "value": pb.get("hit_fraction"),
            "unit": f"{pb.get('hit_tokens')}/{pb.get('doc_tokens')} doc tokens",
        },
        {
            "measure": "pool hits, probe after last restart",
            "value": pa.get("hit_fraction"),
            "unit": f"{pa.get('hit_tokens')}/{pa.get('doc_tokens')} doc tokens",
        },
        {
            "measure": "connector hit tokens: warm-up / kill phase",
            "value": f"{hits.get('warmup', 0):.0f} / {hits.get('kills', 0):.0f}",
        },
    ]


def engine_arguments(ap: argparse.ArgumentParser) -> None:
    """The engine's and the workload's arguments (this drill's and chaos_drill.py's)."""
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--block-size", type=int, default=0, help="0: vLLM's default")
    ap.add_argument("--chunk", type=int, default=0, help="connector chunk_size; 0: its default")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.0)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-bytes", type=int, default=0, help="kv_cache_memory_bytes (CPU: 256Mi)")
    ap.add_argument("--gpu-blocks", type=int, default=0, help="num_gpu_blocks_override; 0: auto")
    ap.add_argument(
        "--device-agnostic",
        action="store_true",
        help="no platform-specific engine argument unless given",
    )
    ap.add_argument("--dtype", default="")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--cuda-graphs", action="store_true", help="no enforce_eager")
    ap.add_argument(
        "--extra-config",
        type=json.loads,
        default=None,
        help="more kv_connector_extra_config keys (JSON)",
    )
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--doc-chunks", type=int, default=3)
    ap.add_argument(
        "--suffix-chunks",
        type=int,
        default=1,
        help="full chunks of each request's own suffix (new stores)",
    )
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--inflight", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=0, help="0: --inflight, at least 8")
    ap.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="requests a second, in --inflight waves; 0: the engine kept full",
    )
    ap.add_argument(
        "--engine-nice",
        type=int,
        default=10,
        help="nice of vLLM's engine processes (0: leave them)",
    )
    ap.add_argument("--stall-s", type=float, default=120.0, help="an engine step without end")


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--reference-server":
        return reference_server(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    engine_arguments(ap)
    ap.add_argument("--kills", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "fault_drill.json"))
    ap.add_argument("--warmup", type=int, default=0, help="warm-up requests; 0: 2 per document")
    ap.add_argument(
        "--kill-delay",
        type=lambda s: tuple(float(x) for x in s.split(",")),
        default=(0.1, 0.8),
        help="LO,HI: seconds from the connector's re-registration to the next kill",
    )
    ap.add_argument("--pool-size", default="64Mi")
    ap.add_argument("--pool-dir", default="", help="default: a new dir on /dev/shm")
    ap.add_argument(
        "--detach-grace",
        type=float,
        default=0.5,
        help="sidecar --detach-grace (its default: 2): also how long an adopted pool holds "
        "evictions; shorter, a full pool stores again within the short lives between kills",
    )
    ap.add_argument("--sidecar-log", default="", help="keep the sidecar's log (all boots) here")
    ap.add_argument(
        "--sidecar-arg", action="append", default=[], help="one more sidecar argument (repeatable)"
    )
    ap.add_argument("--budget-s", type=float, default=600.0, help="kill phase at most")
    ap.add_argument("--serve-s", type=float, default=30.0, help="restart must serve within")
    ap.add_argument("--register-s", type=float, default=30.0, help="re-registration within")
    ap.add_argument("--reference-timeout-s", type=float, default=600.0)
    args = ap.parse_args()
    # vLLM's engine process and workers: spawned, never forked from a process holding gRPC
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

    def terminated(*_: object) -> None:
        raise SystemExit(143)  # unwinds drill_main: its `finally` stops the sidecar

    signal.signal(signal.SIGTERM, terminated)
    return drill_main(args)


def drill_main(args: argparse.Namespace) -> int:
    import shutil

    from kvoffload_cli.sidecar_child import memory_dir

    pool_dir = Path(args.pool_dir) if args.pool_dir else memory_dir("kvo-drill-")
    work_dir = memory_dir("kvo-drill-work-")
    args.socket = str(work_dir / "pool.sock")
    sidecar = Sidecar(sidecar_command(args, pool_dir), args.socket, work_dir / "sidecar.log")
    try:
        return drill_with(args, sidecar)
    finally:
        sidecar.stop()
        if args.sidecar_log:  # every boot's log, for a failure's why
            with contextlib.suppress(OSError):
                shutil.copyfile(sidecar.log_path, args.sidecar_log)
        shutil.rmtree(work_dir, ignore_errors=True)
        if not args.pool_dir:
            shutil.rmtree(pool_dir, ignore_errors=True)


def drill_with(args: argparse.Namespace, sidecar: Sidecar) -> int:
    """Start the sidecar, run the drill, report; the exit status."""
    t_start = time.monotonic()
    work_dir = sidecar.log_path.parent
    sidecar.spawn()
    if sidecar.wait_serving(60)[0] is None:
        print(sidecar.log_path.read_text(errors="replace")[-3000:], file=sys.stderr)
        return 2
    extra: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "extra_config"}}
    state: dict[str, Any] = {}  # drill, killer, ref: what a failure part-way leaves to report
    try:
        run_drill(args, sidecar, work_dir, extra, state)
    except Exception as e:  # noqa: BLE001 - reported, exit status 1
        import traceback

        traceback.print_exc()
        extra["error"] = f"{type(e).__name__}: {e}"
    finally:
        if state.get("killer") is not None:
            state["killer"].stop_event.set()
        sidecar.stop()
    drill, killer, ref = state.get("drill"), state.get("killer"), state.get("ref")
    extra["wall_s"] = time.monotonic() - t_start
    s = summarize(args, drill, killer, ref, extra)
    if killer is not None:
        s["kill_records"] = killer.records
    report(
        "fault drill: SIGKILL the sidecar under load",
        rows_of(s),
        args.out,
        extra=s,
        columns=["measure", "value", "p50", "p99", "min", "max", "unit"],
    )
    print(
        f"{s['kills']} kills, {s['requests_served']} served, {s['requests_failed']} failed, "
        f"{s['differing_tokens']} tokens differ, wall {s['wall_s']:.0f} s"
        + (f", error: {s['error']}" if s.get("error") else "")
    )
    return 0 if s["ok"] else 1


def run_drill(
    args, sidecar: Sidecar, work_dir: Path, extra: dict[str, Any], state: dict[str, Any]
) -> None:
    from vllm import LLM

    t0 = time.monotonic()
    args.gpu_blocks = args.gpu_blocks or auto_gpu_blocks(args)  # the reference's too
    kwargs = engine_kwargs(args)
    llm = LLM(**kwargs, kv_transfer_config=kv_transfer_config(args))
    vc = llm.llm_engine.vllm_config
    block = int(vc.cache_config.block_size)
    chunk = chunk_tokens(llm, args.chunk)
    vocab = int(vc.model_config.get_vocab_size())
    suffix = args.suffix_chunks * chunk + max(1, chunk // 3)
    work = Workload(args.seed, args.docs, args.doc_chunks, chunk, vocab, suffix)
    extra["engine"] = {
        "start_s": time.monotonic() - t0,
        "block_size": block,
        "chunk_tokens": chunk,
        "num_gpu_blocks": vc.cache_config.num_gpu_blocks,
        "prompt_tokens": args.doc_chunks * chunk + suffix,
        "kwargs": {k: v for k, v in kwargs.items() if k != "model"},
    }
    if args.engine_nice:
        pid = sidecar.proc.pid if sidecar.proc else -1
        extra["engine"]["reniced"] = renice_engine(args.engine_nice, keep={pid})
    drill = state["drill"] = Drill(llm, args, work)

    def on_stall() -> None:
        sidecar.stop()
        extra["error"] = "stalled: an engine step did not return"

    watchdog(drill, args.stall_s, on_stall)

    # warm-up: every document stored, the connector registered
    warm = args.warmup or 2 * args.docs
    drill.stream(lambda: len(drill.requests) < warm)
    settle(sidecar)
    extra["probe_before"] = drill.probe("probe_before")
    settle(sidecar)
    counters = {"start": connector_counters()}
    st = sidecar.stats()
    clients = slots(st)["live"] if st is not None else 0
    extra["clients"] = clients
    extra["before_kills"] = slots(st) if st is not None else {}
    extra["generation"] = st.pool_generation if st is not None else ""
    if clients < 1:
        raise RuntimeError("the connector never registered with the sidecar")

    killer = state["killer"] = Killer(sidecar, args, clients)
    drill.phase = "kills"
    t_kills = time.monotonic()
    killer.start()
    drill.stream(lambda: not killer.done.is_set())
    killer.join()
    extra["kill_phase_s"] = time.monotonic() - t_kills
    if killer.error:
        extra["error"] = f"killer: {killer.error}"
    time.sleep(1.0)  # the last steps' stats reach the Prometheus counters
    counters["kills"] = connector_counters()
    extra["probe_after"] = drill.probe("probe_after")
    time.sleep(1.0)
    counters["end"] = connector_counters()
    extra["connector_counters"] = counters
    extra["connector_hit_tokens"] = {
        "warmup": counters["start"].get("hit_tokens", 0.0),
        "kills": counters["kills"].get("hit_tokens", 0.0)
        - counters["start"].get("hit_tokens", 0.0),
    }
    st = sidecar.stats()
    extra["sidecar_at_end"] = slots(st) if st is not None else {}

    # the engine goes before the reference engine starts (one engine at a time)
    drill.last_progress = float("inf")
    with contextlib.suppress(Exception):  # best effort: del + gc below do the rest
        llm.llm_engine.engine_core.shutdown()
    drill.llm = drill.engine = None
    del llm
    gc.collect()
    torch = sys.modules.get("torch")  # an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
    sidecar.stop()
    # one pass over every prompt in large batches (greedy tokens do not depend on the batch)
    kw = dict(kwargs, num_gpu_blocks_override=4 * args.gpu_blocks)
    kw["max_num_seqs"] = max(kw["max_num_seqs"], 32)
    t_ref = time.monotonic()
    reference = Reference(kw, work_dir, args.max_tokens)
    try:
        prompts = [r["prompt"] for r in drill.requests]
        state["ref"] = {"tokens": reference.generate(prompts, args.reference_timeout_s)}
    finally:
        reference.stop()
    extra["reference_s"] = time.monotonic() - t_ref


def auto_gpu_blocks(args: argparse.Namespace) -> int:
    """A GPU cache for the requests in flight, twice over, but far less than the documents:
    most requests miss the GPU prefix cache. Sized with the configured (or vLLM's default)
    block size and chunk."""
    from vllm.platforms import current_platform

    block = args.block_size or (128 if current_platform.is_cpu() else 16)
    chunk = -(-args.chunk // block) * block if args.chunk else 4 * block
    prompt = (args.doc_chunks + args.suffix_chunks + 1) * chunk + args.max_tokens
    per_request = -(-prompt // block)
    return max(2 * args.inflight * per_request, -(-args.max_model_len // block) + 1)


if __name__ == "__main__":
    sys.exit(main())
