"""Warm start after a vLLM restart ("restarts lose nothing"), side by side.

Every engine is a fresh child process (a vLLM restart: clean GPU and host memory), all against
one real `kvoffload sidecar` that this script owns (so it can SIGKILL and restart it). Two
prompts of --tokens tokens, A and B, the same in every configuration. Each child records the
time from its spawn to `LLM(...)` returned, then its FIRST request (A, max_tokens=1: TTFT as
`generate` wall time and vLLM's arrival -> first token), then B (for kvoffload after the
worker's pool registration finished), then B again (a GPU prefix hit). Scenarios:

    a) kvo-layer   kvoffload as shipped. A seed process runs A and B (cold: stored in the pool),
                   waits until the sidecar's Stats show the stores committed, exits; then every
                   measuring process is a restart whose first request should hit the pool.
    b) none        no KV connector: the first request recomputes A (a 100K prefill).
    c) offloading  vLLM's OffloadingConnector (the e2e_gpu.py config, cpu_bytes_to_use =
                   --cpu-gib): a seed process runs A and exits (its CPU pool dies with it);
                   each later process recomputes.
    d) start-up    spawn -> LLM ready per configuration (and, for kvoffload, spawn -> the pool
                   registered for DMA), from the same processes.
    e) --sidecar-restart: after round 1, SIGKILL the sidecar, restart it on the same pool file
                   (it adopts the committed blocks), then one more kvoffload restart.

Round 1 runs a, b, c once (the comparison that matters, first); later rounds repeat them in
rotated order (bench/harness.py rotations) while the budget lasts; a step that would not fit
is skipped. The JSON is rewritten after every child (a timeout keeps what was measured).
Before a kvoffload restart the pool must hold A and B, else a seed runs first (a sidecar that
did not adopt its pool lost them). PYTHONHASHSEED is set (0 unless set) for every child, as the
operator's injector does: vLLM 0.26 seeds its block hashes randomly per process without it, and
a restarted engine's keys would then never match the pool's.

    python bench/warm_start.py --model bench/e2e_models/llama3-8b --tokens 100000 \
        [--reps 3] [--sidecar-restart] [--budget-s 520] [--out bench/results/warm_start.json]

`bash bench/gpu_run.sh warm_start BUDGET_S [flags]` runs it on the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

T_MAIN = time.time()  # this interpreter reached our code (a child's "main" mark)
ROOT = Path(__file__).resolve().parents[1]
for _p in ("bench", "connector", "sidecar", "protos/gen", "cli"):
    if str(ROOT / _p) not in sys.path:
        sys.path.insert(0, str(ROOT / _p))

import e2e_gpu as e2e  # noqa: E402 - after the path set-up above
from harness import machine, report, rotations, spread, table  # noqa: E402

CONFIGS = ("kvo-layer", "none", "offloading")
LABELS = {
    "kvo-layer": "a) kvoffload restart",
    "kvo-layer/sidecar": "e) kvoffload, sidecar restarted",
    "none": "b) recompute (no connector)",
    "offloading": "c) OffloadingConnector restart",
    "kvo-layer/seed": "kvoffload seed (cold)",
    "offloading/seed": "OffloadingConnector seed (cold)",
}
PCIE_GBPS = e2e.PCIE_GBPS


def pool_counts(socket: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """The sidecar's Stats summed over namespaces (ints), with its adoption record; {"error"}
    when it does not answer."""
    try:
        import grpc
        from kvoffload.v1 import pool_pb2, pool_pb2_grpc

        with grpc.insecure_channel(f"unix://{socket}") as ch:
            st = pool_pb2_grpc.KVPoolStub(ch).Stats(pool_pb2.StatsRequest(), timeout=timeout_s)
    except Exception as e:  # noqa: BLE001 - a missing sidecar is a result here
        return {"error": f"{type(e).__name__}: {e}"}
    keys = (
        "committed_slots",
        "reserved_slots",
        "pinned_slots",
        "lookups",
        "hit_blocks",
        "miss_blocks",
        "stored_blocks",
        "loaded_blocks",
        "evicted_blocks",
        "stored_bytes",
        "loaded_bytes",
    )
    out: dict[str, Any] = {k: sum(int(getattr(ns, k)) for ns in st.namespaces) for k in keys}
    out["namespaces"] = len(st.namespaces)
    out["pool_generation"] = st.pool_generation
    out["prefaulted_bytes"] = int(st.prefaulted_bytes)
    out["pool_ready"] = bool(st.pool_ready)
    out["uptime_s"] = round(float(st.uptime_seconds), 2)
    ad = getattr(st, "adoption", None)
    if ad is not None:
        out["adoption"] = {
            "outcome": ad.outcome,
            "reason": ad.reason,
            "format_version": int(ad.format_version),
            "adopted_blocks": int(ad.adopted_blocks),
            "adopted_namespaces": int(ad.adopted_namespaces),
            "discarded_blocks": {k: int(v) for k, v in ad.discarded_blocks.items()},
            "adopt_seconds": round(float(ad.adopt_seconds), 3),
            "boots": int(ad.boots),
        }
    return out


def counts_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    return {
        k: after[k] - before[k]
        for k in ("lookups", "hit_blocks", "miss_blocks", "stored_blocks", "loaded_blocks")
        if isinstance(after.get(k), int) and isinstance(before.get(k), int)
    }


# -- one engine (child process) ------------------------------------------------------------------


class WarmChild(e2e.Child):
    """One fresh engine: its start marks, then the role's requests; the result saved after each."""

    def __init__(self, args: argparse.Namespace):
        # what e2e_gpu.Child.start()/timed() read, fixed here
        args.profile = False
        args.round = 1
        args.settle_s = 0.25
        args.sizes = [args.tokens]
        args.gpu_blocks = args.gpu_blocks or None
        super().__init__(args)
        self.kvo = args.config.startswith("kvo")
        self.result.update(
            {
                "role": args.role,
                "step": args.step,
                "marks": {"spawned": args.spawned, "main": T_MAIN},
                "requests": [],
            }
        )
        self.marks: dict[str, float] = self.result["marks"]
        self.last_outs: list[Any] = []
        self.last_submit = 0.0
        self.pool_ready_at: float | None = None
        self.pool_ready_how = ""

    def log(self, msg: str) -> None:
        print(
            f"[warm {self.args.config}/{self.args.role} {self.left():5.0f}s left] {msg}", flush=True
        )

    def mark(self, name: str, at: float | None = None) -> None:
        self.marks[name] = at if at is not None else time.time()

    def since_spawn(self, name: str) -> float | None:
        at = self.marks.get(name)
        return None if at is None else round(at - self.args.spawned, 3)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[Any], float]:
        self.last_submit = time.time()
        outs, wall = super().generate(prompts, max_tokens)
        self.last_outs = outs
        return outs, wall

    # kvoffload: when the worker's pool became usable for copies (the CUDA registration)
    def watch_pool(self) -> None:
        """Record when the worker's pool is ready: the pool view's own log line (its time of
        emission) or, failing that, a 5 ms poll of `worker.ready` from LLM-ready on."""

        class Hook(logging.Handler):
            def emit(hook, record: logging.LogRecord) -> None:  # noqa: N805
                if "pool registered" in record.getMessage() and self.pool_ready_at is None:
                    self.pool_ready_at, self.pool_ready_how = record.created, "log"

        logger = logging.getLogger("kvoffload_connector.worker.pool_view")
        logger.addHandler(Hook(level=logging.INFO))
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)

    def poll_pool_ready(self) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = getattr(get_kv_transfer_group(), "_worker", None)
        if worker is None:
            self.result["pool_watch"] = "no kvoffload worker (connector disabled?)"
            return

        def poll() -> None:
            end = time.time() + 300
            while time.time() < end and self.pool_ready_at is None:
                if getattr(worker, "ready", False):
                    self.pool_ready_at, self.pool_ready_how = time.time(), "poll"
                    return
                time.sleep(0.005)

        threading.Thread(target=poll, name="warm-pool-poll", daemon=True).start()
        self.result["chunk_tokens"] = int(worker.chunk_blocks * worker.block_size)

    def request(self, name: str, prompt: list[int], settle_s: float) -> dict[str, Any]:
        """One timed request (max_tokens=1) with its marks and the sidecar's counters around it."""
        pool_before = pool_counts(self.args.socket) if self.kvo else {}
        sample = self.timed(prompt, settle_s=settle_s)
        submit = self.last_submit
        done = time.time()
        m = getattr(self.last_outs[0], "metrics", None) if self.last_outs else None
        first_token = None
        arrival = getattr(m, "arrival_time", 0.0) if m is not None else 0.0
        if m is not None and arrival and getattr(m, "first_token_latency", 0.0):
            first_token = arrival + m.first_token_latency
        rec: dict[str, Any] = {
            "name": name,
            **asdict(sample),
            "hit_fraction": round(sample.cached_tokens / len(prompt), 4),
            "submit_s": round(submit - self.args.spawned, 3),
            "done_s": round(done - self.args.spawned, 3),
            "first_token_s": round(first_token - self.args.spawned, 3) if first_token else None,
            "pool_ready_before": self.pool_ready_at is not None and self.pool_ready_at <= submit,
        }
        if self.kvo:
            after = pool_counts(self.args.socket)
            rec["sidecar"] = counts_delta(pool_before, after)
        self.result["requests"].append(rec)
        self.save()
        self.log(
            f"{name}: {sample.wall_ms:.0f} ms, cached {sample.cached_tokens}/{len(prompt)}"
            + (f", sidecar {rec['sidecar']}" if self.kvo else "")
        )
        return rec

    def wait_stored(self, need: int) -> None:
        """Until the pool holds `need` committed chunks with no store open, stable 0.5 s
        (bounded by --store-wait-s): the engine's stores land before this process exits.
        No request runs meanwhile: this child's engine is in-process, and the connector
        sends an in-process engine's stores with the step that planned them
        (docs/CONNECTOR.md, "Work that finishes between engine steps").
        """
        t0 = time.time()
        last, since, st = -1, t0, {}
        while time.time() - t0 < self.args.store_wait_s:
            st = pool_counts(self.args.socket)
            committed = st.get("committed_slots", -1)
            if committed != last or st.get("reserved_slots") or committed < need:
                last, since = committed, time.time()
            elif time.time() - since >= 0.5:
                break
            time.sleep(0.05)
        self.result["stores"] = {
            "need_chunks": need,
            "committed_slots": st.get("committed_slots"),
            "reserved_slots": st.get("reserved_slots"),
            "stored_bytes": st.get("stored_bytes"),
            "wait_s": round(time.time() - t0, 2),
            "complete": st.get("committed_slots", -1) >= need and not st.get("reserved_slots"),
        }
        self.save()

    def run(self) -> int:
        a = self.args
        try:
            if self.kvo:
                self.watch_pool()
            import vllm  # noqa: F401 - timed apart from the engine start

            self.mark("vllm_imported")
            self.log("starting engine")
            self.start()
            self.mark("llm_ready")
            self.watchdog(a.stall_s)
            if self.kvo:
                self.poll_pool_ready()
            self.log(f"engine up {self.since_spawn('llm_ready')} s after spawn")
            vocab = self.shape.vocab
            pa = e2e.token_prompt(e2e.seed_of("warm-start", "A", a.tokens), a.tokens, vocab)
            pb = e2e.token_prompt(e2e.seed_of("warm-start", "B", a.tokens), a.tokens, vocab)
            # the first request goes in at once: what a restarted server's first client sees
            self.request("first", pa, settle_s=0.0)
            if a.role == "seed" and not self.kvo:
                pass  # OffloadingConnector's process 1: A only, then exit (its CPU pool dies)
            else:
                if self.kvo and a.role != "seed":
                    self.result["pool_ready_wait_s"] = self.wait_pool_ready()
                self.request("second", pb, settle_s=a.settle_s)
                if a.role != "seed":
                    self.request("gpu_hit", pb, settle_s=a.settle_s)
            if self.kvo:
                chunk = self.result.get("chunk_tokens") or 0
                need = 2 * (a.tokens // chunk) if chunk else 0
                self.wait_stored(need)
            self.result["status"] = "ok"
            return 0
        except Exception as e:  # noqa: BLE001 - the parent records it and goes on
            return self.failed(e)
        finally:
            if self.pool_ready_at is not None:
                self.mark("pool_ready", self.pool_ready_at)
                self.result["pool_ready_how"] = self.pool_ready_how
            self.result["since_spawn"] = {k: self.since_spawn(k) for k in self.marks}
            self.save()


# -- the parent: sidecar, children, tables -------------------------------------------------------


class Parent:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out = Path(args.out)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = Path(args.log) if args.log else self.out.with_suffix(".log")
        self.t_end = time.time() + args.budget_s
        self.shape = e2e.model_shape(Path(args.model))
        self.gpu = self.gpu_name()
        self.machine = machine()
        self.children: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.sidecar: Any = None
        self.need_chunks = 0
        self.prefill_s = args.tokens / 10_000  # updated from the first cold request
        self.skip_config: dict[str, str] = {}
        self.step = 0

    @staticmethod
    def gpu_name() -> str:
        try:  # not torch: a CUDA context here would hold GPU memory all run long
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
            return smi.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            return "none"

    def left(self) -> float:
        return self.t_end - time.time()

    def say(self, msg: str) -> None:
        print(f"[warm {self.left():5.0f}s left] {msg}", flush=True)

    # sidecar
    def start_sidecar(self) -> None:
        from kvoffload_cli.sidecar_child import SidecarProcess

        pool_dir = Path(self.args.pool_dir)
        if pool_dir.exists():  # a pool file left from an earlier run would be adopted
            shutil.rmtree(pool_dir)
        pool_dir.mkdir(parents=True)
        log = Path(self.args.sidecar_log) if self.args.sidecar_log else None
        self.sidecar = SidecarProcess(f"{self.args.pool_gib}Gi", workdir=pool_dir, log_path=log)
        t0 = time.time()
        self.sidecar.start(timeout_s=120)
        self.events.append(
            {"event": "sidecar started", "serving_s": round(time.time() - t0, 2)}
            | {"stats": pool_counts(self.sidecar.socket)}
        )

    def restart_sidecar(self) -> dict[str, Any]:
        """SIGKILL, then the same command on the same pool dir and size (it adopts the file)."""
        before = pool_counts(self.sidecar.socket)
        t0 = time.time()
        self.sidecar.kill()
        self.sidecar.start(timeout_s=120)
        after = pool_counts(self.sidecar.socket)
        ev = {
            "event": "sidecar SIGKILLed and restarted",
            "serving_s": round(time.time() - t0, 2),
            "committed_before": before.get("committed_slots"),
            "committed_after": after.get("committed_slots"),
            "generation_kept": before.get("pool_generation") == after.get("pool_generation"),
            "adoption": after.get("adoption"),
        }
        self.events.append(ev)
        self.say(f"sidecar restarted: {ev}")
        return ev

    def pool_has_prompts(self) -> bool:
        if not self.need_chunks:
            return False
        return pool_counts(self.sidecar.socket).get("committed_slots", -1) >= self.need_chunks

    # time planning
    def start_estimate(self, config: str) -> float:
        """Spawn -> LLM ready: the most seen for `config`, else for any configuration, leaving
        out the call's first child (a fresh machine's cold caches) once others exist; before
        any, --first-start-s."""
        timed = [c for c in self.children if c.get("ready_s")]
        later = timed[1:] or timed
        mine = [c["ready_s"] for c in later if c["config"] == config]
        vals = mine or [c["ready_s"] for c in later]
        return max(vals) if vals else self.args.first_start_s

    def estimate(self, config: str, role: str) -> float:
        kvo = config.startswith("kvo")
        # kvoffload measures: the first request may miss (the pool not registered yet), the
        # second hits; seeds compute both prompts (kvoffload) or one (OffloadingConnector)
        prefills = {"seed": 2 if kvo else 1}.get(role, 1 if kvo else 2)
        store = 5 + 2 * self.shape.kv_bytes(self.args.tokens) / 5e9 if role == "seed" else 0
        ready = 10 if kvo else 0
        return self.start_estimate(config) + prefills * self.prefill_s + store + ready + 10

    # one child
    def child(self, config: str, role: str, tag: str = "") -> dict[str, Any] | None:
        if config in self.skip_config:
            return None
        est = self.estimate(config, role)
        self.step += 1
        label = f"{config}/{role}" + (f"/{tag}" if tag else "")
        if self.left() < est + self.args.reserve_s:
            self.say(f"skip {label}: needs ~{est:.0f} s")
            self.children.append(
                {"step": self.step, "config": config, "role": role, "tag": tag,
                 "status": f"skipped: out of time (needs ~{est:.0f} s)"}
            )  # fmt: skip
            self.save()
            return None
        result = self.out.with_name(f"{self.out.stem}.step{self.step}.part.json")
        result.unlink(missing_ok=True)
        limit = min(self.left() - self.args.reserve_s / 2, 2 * est + 60)
        self.say(f"step {self.step}: {label} (estimate {est:.0f} s, limit {limit:.0f} s)")
        spawned = time.time()
        argv = self.child_argv(config, role, result, spawned, spawned + limit - 5)
        env = dict(os.environ)
        env.setdefault("PYTHONHASHSEED", "0")
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        with open(self.log_path, "a") as log:
            log.write(f"\n===== step {self.step}: {label} =====\n")
            log.flush()
            try:
                proc = subprocess.run(
                    argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    timeout=limit,
                    check=False,
                )
                rc: int | str = proc.returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        try:
            run = json.loads(result.read_text())
            result.unlink()
        except (OSError, ValueError):
            run = {"status": "no result"}
        run.update(
            {"step": self.step, "config": config, "role": role, "tag": tag, "returncode": rc}
        )
        run["wall_s"] = round(time.time() - spawned, 1)
        run["ready_s"] = (run.get("since_spawn") or {}).get("llm_ready")
        if self.sidecar is not None:
            run["pool_after"] = pool_counts(self.sidecar.socket)
        chunk = run.get("chunk_tokens")
        if chunk and config.startswith("kvo"):
            self.need_chunks = 2 * (self.args.tokens // int(chunk))
        reqs = {r["name"]: r for r in run.get("requests", [])}
        cold = [r for r in reqs.values() if r["cached_tokens"] == 0 and r["name"] != "gpu_hit"]
        if cold:  # the prefill rate for the time plan
            self.prefill_s = max(1.0, statistics.median(r["wall_ms"] for r in cold) / 1e3)
        if run.get("status") != "ok" and config == "offloading" and self.gpu == "none":
            reason = run.get("error") or f"no result (rc {rc})"
            self.skip_config[config] = f"skipped on CPU: OffloadingConnector failed: {reason}"
            run["status"] = self.skip_config[config]
        self.children.append(run)
        first = reqs.get("first", {})
        self.say(
            f"   {label}: {run.get('status')} rc {rc}, ready {run['ready_s']} s, first "
            f"{first.get('wall_ms', float('nan')):.0f} ms cached {first.get('cached_tokens')}"
        )
        self.save()
        return run

    def child_argv(
        self, config: str, role: str, result: Path, spawned: float, deadline: float
    ) -> list[str]:
        a = self.args
        argv = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            "--config",
            config,
            "--role",
            role,
            "--step",
            str(self.step),
            "--result",
            str(result),
            "--spawned",
            f"{spawned:.6f}",
            "--deadline",
            f"{deadline:.1f}",
            "--socket",
            self.sidecar.socket if self.sidecar is not None else "",
        ]
        keep = (
            "model",
            "tokens",
            "max_model_len",
            "gpu_blocks",
            "gpu_mem_util",
            "dtype",
            "block_size",
            "cpu_gib",
            "kvo_chunk",
            "stall_s",
            "store_wait_s",
        )
        for k in keep:
            argv += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
        if a.cuda_graphs:
            argv.append("--cuda-graphs")
        return argv

    # the plan
    def kvo_restart(self, tag: str = "") -> None:
        if not self.pool_has_prompts():
            self.say("the pool lacks A and B: a kvoffload seed first")
            self.child("kvo-layer", "seed", "reseed" if self.need_chunks else "")
        self.child("kvo-layer", "measure", tag)

    def run(self) -> int:
        a = self.args
        if "kvo-layer" in a.configs:
            self.start_sidecar()
        try:
            seeded_offloading = False
            for rnd, order in enumerate(rotations(list(a.configs), a.reps), start=1):
                for config in order:
                    if config == "kvo-layer":
                        self.kvo_restart()
                    elif config == "offloading":
                        if not seeded_offloading:
                            self.child("offloading", "seed")
                            seeded_offloading = True
                        self.child("offloading", "measure")
                    else:
                        self.child(config, "measure")
                if rnd == 1 and a.sidecar_restart and self.sidecar is not None:
                    if not self.pool_has_prompts():
                        self.child("kvo-layer", "seed", "before sidecar restart")
                    if self.left() > self.estimate("kvo-layer", "measure") + a.reserve_s + 10:
                        self.restart_sidecar()
                        self.child("kvo-layer", "measure", "sidecar")
        finally:
            if self.sidecar is not None:
                self.events.append({"event": "end", "stats": pool_counts(self.sidecar.socket)})
                self.sidecar.stop()
                shutil.rmtree(self.sidecar.workdir, ignore_errors=True)
        payload = self.payload()
        report(
            "warm_start",
            payload["rows"],
            self.out,
            extra={k: v for k, v in payload.items() if k != "rows"},
            columns=list(payload["rows"][0]) if payload["rows"] else None,
        )
        print()
        print(table(payload["startup"]))
        print()
        print("\n".join(payload["notes"]))
        return 0

    # results
    def scenario(self, run: dict[str, Any]) -> str:
        if run["role"] == "seed":
            return f"{run['config']}/seed"
        if run.get("tag") == "sidecar":
            return f"{run['config']}/sidecar"
        return run["config"]

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per scenario (in table order): the spreads over its processes, as numbers."""
        order = ["kvo-layer", "kvo-layer/sidecar", "none", "offloading", "kvo-layer/seed",
                 "offloading/seed"]  # fmt: skip
        runs: dict[str, list[dict[str, Any]]] = {}
        for c in self.children:
            if c.get("requests"):
                runs.setdefault(self.scenario(c), []).append(c)
        out: dict[str, dict[str, Any]] = {}
        for key in order:
            rs = runs.get(key)
            if not rs:
                continue

            def req(name: str, field: str, rs: list[dict[str, Any]] = rs) -> list[float]:
                return [
                    float(q[field])
                    for r in rs
                    for q in r["requests"]
                    if q["name"] == name and q.get(field) is not None
                ]

            since = [r.get("since_spawn") or {} for r in rs]
            out[key] = {
                "label": LABELS.get(key, key),
                "steps": [r["step"] for r in rs],
                "ready_s": [s["llm_ready"] for s in since if s.get("llm_ready") is not None],
                "pool_ready_s": [s["pool_ready"] for s in since if s.get("pool_ready") is not None],
                **{
                    f"{name}_{field}": req(name, field)
                    for name in ("first", "second", "gpu_hit")
                    for field in ("wall_ms", "ttft_ms", "hit_fraction", "done_s", "submit_s")
                },
            }
        return out

    def rows(self, summary: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        """One row per scenario: medians (min-max) over its processes."""

        def pct(vals: list[float]) -> str:
            return f"{statistics.median(vals):.0%}" if vals else "-"

        return [
            {
                "scenario": s["label"],
                "n": len(s["steps"]),
                "ready s": cell(s["ready_s"], 1),
                "pool ready s": cell(s["pool_ready_s"], 1),
                "first TTFT ms": cell(s["first_wall_ms"]),
                "vLLM TTFT ms": cell(s["first_ttft_ms"]),
                "first hit": pct(s["first_hit_fraction"]),
                "spawn->token s": cell(s["first_done_s"], 1),
                "2nd TTFT ms": cell(s["second_wall_ms"]),
                "2nd hit": pct(s["second_hit_fraction"]),
                "GPU hit ms": cell(s["gpu_hit_wall_ms"]),
            }
            for s in summary.values()
        ]

    def startup(self) -> list[dict[str, Any]]:
        """(d): spawn -> vLLM imported -> LLM ready (-> pool registered), per configuration;
        the call's first child (a fresh machine's caches) is shown apart."""
        first_step = min((c["step"] for c in self.children if c.get("since_spawn")), default=0)
        groups: dict[str, list[dict[str, float]]] = {}
        for c in self.children:
            ss = c.get("since_spawn")
            if not ss or ss.get("llm_ready") is None:
                continue
            key = c["config"] + (" (first child)" if c["step"] == first_step else "")
            groups.setdefault(key, []).append(ss)
        rows = []
        for key, ss in sorted(groups.items()):
            imp = [s["vllm_imported"] for s in ss if s.get("vllm_imported") is not None]
            llm = [
                s["llm_ready"] - s["vllm_imported"]
                for s in ss
                if s.get("vllm_imported") is not None
            ]
            pool = [s["pool_ready"] for s in ss if s.get("pool_ready") is not None]
            rows.append(
                {
                    "start-up (d)": key,
                    "n": len(ss),
                    "import s": cell(imp, 1),
                    "LLM() s": cell(llm, 1),
                    "spawn->ready s": cell([s["llm_ready"] for s in ss], 1),
                    "spawn->pool registered s": cell(pool, 1) if pool else "-",
                }
            )
        return rows

    def payload(self) -> dict[str, Any]:
        kv = self.shape.kv_bytes(self.args.tokens)
        ideal_ms = kv / (PCIE_GBPS * 1e9) * 1e3
        notes = [
            f"model {self.shape.name}, {self.args.tokens:,}-token prompt, GPU {self.gpu}; KV "
            f"{kv / 1e9:.2f} GB: at {PCIE_GBPS:.0f} GB/s (PCIe ceiling) {ideal_ms:.0f} ms",
            "ms/s: median (min-max) over processes; 'first' = the restarted engine's first "
            "request (A), '2nd' = B next (kvoffload: once its pool registered), 'GPU hit' = B "
            "again",
        ]
        gpu = [
            q["wall_ms"]
            for c in self.children
            if c["config"] == "kvo-layer"
            for q in c.get("requests", [])
            if q["name"] == "gpu_hit"
        ]
        if gpu:
            floor = statistics.median(gpu) + ideal_ms
            notes.append(f"floor for a pool hit: GPU hit {statistics.median(gpu):.0f} ms + "
                         f"{ideal_ms:.0f} ms = {floor:.0f} ms")  # fmt: skip
        for c in self.children:
            first = next((q for q in c.get("requests", []) if q["name"] == "first"), None)
            if c["config"] == "kvo-layer" and c["role"] == "measure" and first:
                ready = (c.get("since_spawn") or {}).get("pool_ready")
                notes.append(
                    f"step {c['step']} {self.scenario(c)}: first request submitted "
                    f"{first['submit_s']:.1f} s after spawn, pool registered "
                    + (f"{ready:.1f} s" if ready is not None else "never (in this process)")
                    + f", hit {first['hit_fraction']:.0%}, sidecar {first.get('sidecar')}"
                )
        for ev in self.events:
            if ev["event"].startswith("sidecar SIGKILLed"):
                notes.append(f"sidecar restart: {ev}")
        bad = [
            f"step {c['step']} {c['config']}/{c['role']}: {c.get('status')}"
            + ("" if str(c.get("status")).startswith("skipped") else f" {c.get('error', '')}")
            for c in self.children
            if c.get("status") != "ok"
        ]
        if bad:
            notes.append("not ok: " + "; ".join(bad))
        summary = self.summary()
        return {
            "rows": self.rows(summary),
            "summary": {
                k: {
                    f: spread(v) if isinstance(v, list) and f != "steps" else v
                    for f, v in s.items()
                }
                for k, s in summary.items()
            },  # fmt: skip
            "startup": self.startup(),
            "notes": notes,
            "gpu": self.gpu,
            "model": self.shape.name,
            "shape": self.shape.__dict__,
            "tokens": self.args.tokens,
            "kv_bytes": kv,
            "ideal_ms_at_pcie": ideal_ms,
            "pcie_gbps": PCIE_GBPS,
            "argv": sys.argv[1:],
            "child_env": {"PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0")},
            "children": self.children,
            "events": self.events,
        }

    def save(self) -> None:
        """The JSON as it stands (after every child): what a timeout leaves behind."""
        payload = {"benchmark": "warm_start", "machine": self.machine, **self.payload()}
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload, indent=1, default=str) + "\n")
        tmp.replace(self.out)


def cell(values: list[float], digits: int = 0) -> str:
    """'median (min-max)' of values, the value alone for one, '-' for none."""
    if not values:
        return "-"
    s = spread(values)
    fmt = f"{{:,.{digits}f}}"
    if s["n"] == 1:
        return fmt.format(s["p50"])
    return f"{fmt.format(s['p50'])} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"


# -- command line ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=str(ROOT / "bench/e2e_models/llama3-8b"))
    p.add_argument("--tokens", type=int, default=100_000, help="prompt length (A and B)")
    p.add_argument("--reps", type=int, default=3, help="rounds of a, b, c (rotated order)")
    p.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        type=lambda s: e2e.parse_list(s, CONFIGS, "configs"),
        help="a subset of kvo-layer,none,offloading",
    )
    p.add_argument(
        "--sidecar-restart",
        action="store_true",
        help="(e) after round 1: SIGKILL + restart the sidecar, then one more kvoffload restart",
    )
    p.add_argument("--out", default=str(ROOT / "bench/results/warm_start.json"))
    p.add_argument("--log", default="", help="engines' output (default: OUT with .log)")
    p.add_argument("--sidecar-log", default="", help="sidecar output (default: in --pool-dir)")
    p.add_argument("--budget-s", type=float, default=520, help="wall budget of the whole run")
    p.add_argument("--reserve-s", type=float, default=10, help="kept for the end")
    p.add_argument(
        "--first-start-s",
        type=float,
        default=90,
        help="spawn -> LLM ready assumed before any child measured it (a fresh machine)",
    )
    p.add_argument("--pool-dir", default="/dev/shm/kvo-warm", help="the sidecar's pool dir")
    p.add_argument(
        "--pool-gib", type=int, default=32, help="sidecar pool (A + B: 2 x 13.1 GB at 100K)"
    )
    p.add_argument("--cpu-gib", type=float, default=32, help="OffloadingConnector capacity")
    p.add_argument("--max-model-len", type=int, default=102_400)
    p.add_argument(
        "--gpu-blocks", type=int, default=0, help="num_gpu_blocks_override (0: vLLM sizes it)"
    )
    p.add_argument("--gpu-mem-util", type=float, default=0.9)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-size", type=int, default=0, help="0: vLLM's default (16 on CUDA)")
    p.add_argument("--kvo-chunk", type=int, default=0, help="kvoffload chunk_size (0: default)")
    p.add_argument(
        "--cuda-graphs", action="store_true", help="vLLM's compile + CUDA graphs (default: eager)"
    )
    p.add_argument("--stall-s", type=float, default=120, help="a generate() this long is a hang")
    p.add_argument("--store-wait-s", type=float, default=60, help="seed: wait for commits")
    # child-only
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", default="none", help=argparse.SUPPRESS)
    p.add_argument("--role", default="measure", help=argparse.SUPPRESS)
    p.add_argument("--step", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    p.add_argument("--spawned", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--socket", default="", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tokens + 1 > args.max_model_len:
        raise SystemExit("--max-model-len must hold --tokens + 1")
    if args.child:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        rc = WarmChild(args).run()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)  # no engine shutdown: a restart is a process ending, its stores landed
    return Parent(args).run()


if __name__ == "__main__":
    sys.exit(main())
