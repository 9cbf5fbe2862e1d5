"""The chaos drill: a real vLLM engine serves through the kvoffload connector at its shipped
defaults while its sidecar is frozen past every deadline and killed for longer than the detach
grace; every output is compared token by token with an engine without kvoffload.

What makes it hard for the pool (and what fault_drill.py beside this, whose restarts land inside the
grace, does not do):
- the connector's `kv_connector_extra_config` names only the socket and the chunk: lookup and
  RPC deadlines, reconnect backoff, everything else shipped; the sidecar runs with its own
  `--detach-grace` (2 s) and reserved-slot hold;
- a pool far smaller than the working set (every request stores a chunk of its own: constant
  eviction), shared-prefix documents with a few hot ones (frequent pool hits);
- a GPU KV cache of about two requests and a short running queue (`max_num_seqs` above what the
  cache holds, more requests in flight): requests wait with their lookup answered (slots pinned)
  while others decode;
- vLLM's priority policy: every --low-period-s of the chaos phase (at most --low-max at once) a
  request of lower priority joins in a short pause of the others, so the scheduler reaches it
  (its lookup answered, no room to run); the others then keep the engine full ahead of it and it
  waits, its answer held, across a fault and the grace after it (its pins released, its slots
  evicted and written again by other stores), until a lull admits it;
- a chaos thread that, at random moments (seeded), cycles through: SIGSTOP for longer than every
  deadline (lookup, RPC, detach grace), then SIGCONT; SIGKILL, down longer than the detach grace,
  restart with the same command line (the pool file adopted); SIGSTOP, then SIGKILL while frozen,
  down, restart. Every other event is a lull: no new request from --drain-after-s into the fault
  until its end, so the waiting ones (low priority included) are admitted while no sidecar
  answers (a stale answer cannot be asked again then).

Phases (each request records the phase it started in): `warmup` (no faults), `chaos`, `recover`
(no faults: the pool must serve hits again), then the negative control `scribble`: noise written
over the bytes of every committed slot of the pool file, again and again, while requests run
(the comparison must see differing tokens, or it could not see wrong bytes at all). The engine
without kvoffload (a child process started beside this one, so the two start together) then
runs every prompt once; the report counts differing tokens per phase.

Placement (--placement): `pod`, a sidecar on a pool file, as above; `node`, the pool of node
placement: a `kvoffload node-holder` (kept for the whole run: it keeps the tenant's memfd), a
`kvoffload node-agent` beside it granting one tenant, and the kubelet stand-in
(bench/node_standin.py) publishing one pod's volume through the agent's CSI NodePublishVolume;
the connector (`placement: node`) uses that pod's `pool.sock` and `memory.sock`, the faults are
the agent's (a restart re-binds the pod's sockets and adopts the tenant's index from the memfd
the holder lends again), and the scribbles go over the tenant's memfd taken from `memory.sock`;
`pod,node`: one engine after the other (the node one on prompts of its own), one reference
engine for both. The pod run reports at the top of the JSON, the node run under `node`.

    python tests/drill/chaos_drill.py [--chaos-s 60] [--events N] [--seed 0] [--out JSON]
        [--phases ...] [--placement pod|node|pod,node]
        [--engine-env VAR=VALUE] [--sidecar-env VAR=VALUE]

`--engine-env` / `--sidecar-env` set variables in the kvoffload engine's processes (this one, its
engine core and workers; not the reference engine) and in every sidecar start (not the node
agent's): the hook for controls that switch a product safeguard off (the drill must then see
differing tokens).
Exit status: 0 when the phases without scribbles served every request with 0 differing tokens
and (when it ran) `scribble` differed; 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import mmap
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import fault_drill as fd  # noqa: E402 - sets up the import path of a checkout without install
from harness import report, spread  # noqa: E402

PHASES = ("warmup", "chaos", "recover", "scribble")
FAULTLESS = ("warmup", "chaos", "recover")  # the phases whose outputs must match
EVENTS = ("freeze", "kill", "freeze_kill")  # the chaos thread's cycle


def sidecar_defaults() -> dict[str, float]:
    """The shipped sidecar and connector timings the drill's faults must outlast."""
    from kvoffload_connector.common.client import REGISTER_TIMEOUT_S
    from kvoffload_connector.common.config import ConnectorConfig
    from kvoffload_sidecar.config import SidecarConfig

    c = ConnectorConfig()
    return {
        "detach_grace_s": SidecarConfig.detach_grace_s,
        "lookup_timeout_s": c.lookup_timeout_ms / 1e3,
        "rpc_timeout_s": c.rpc_timeout_ms / 1e3,
        "register_timeout_s": REGISTER_TIMEOUT_S,
    }


# -- the faults ---------------------------------------------------------------------------


class Chaos(threading.Thread):
    """Freezes and kills the sidecar at random moments for `chaos_s`, cycling through EVENTS,
    and records each event: the sidecar's slots just before it (what was in flight), how long
    it was frozen or down, when the restarted one served and the connector registered again."""

    def __init__(self, sidecar: fd.Sidecar, args: argparse.Namespace, clients: int):
        super().__init__(name="chaos", daemon=True)
        self.sidecar, self.args, self.clients = sidecar, args, clients
        self.rng = random.Random(f"chaos-{args.seed}")
        self.records: list[dict[str, Any]] = []
        self.stop_event = threading.Event()
        self.done = threading.Event()
        self.draining = threading.Event()  # a lull: the engine loop adds no request
        self.error = ""

    def run(self) -> None:
        try:
            self._run()
        except Exception as e:  # noqa: BLE001 - the report says what stopped the drill
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.draining.clear()
            self.sidecar.thaw()
            self.done.set()

    def _run(self) -> None:
        start = time.monotonic()
        for k in range(self.args.events or 10**6):
            if time.monotonic() - start >= self.args.chaos_s:
                break
            if self.stop_event.wait(self.rng.uniform(*self.args.gap_s)):
                break
            kind = EVENTS[k % len(EVENTS)]
            st = self.sidecar.stats(timeout_s=1.0)
            rec: dict[str, Any] = {
                "event": k,
                "kind": kind,
                "t": round(time.monotonic() - start, 3),
                "before": fd.slots(st) if st is not None else {},
                "drain": k % 2 == 1,
            }
            if kind in ("freeze", "freeze_kill"):
                self._freeze(rec, kind == "freeze")
            if kind in ("kill", "freeze_kill"):
                self._kill(rec)
            self.records.append(rec)

    def _lull(self, rec: dict[str, Any], t0: float) -> None:
        """From `drain_after_s` after the fault began (the connector's deadlines passed), when
        this event is a lull: no new request until the fault ends."""
        if rec["drain"] and not self.draining.is_set():
            time.sleep(max(0.0, self.args.drain_after_s - (time.monotonic() - t0)))
            self.draining.set()

    def _freeze(self, rec: dict[str, Any], thaw: bool) -> None:
        want = self.rng.uniform(*self.args.freeze_s)
        t0 = time.monotonic()
        self.sidecar.freeze()
        assert self.sidecar.proc is not None
        rec["stopped"] = fd.process_state(self.sidecar.proc.pid) in ("T", "t")
        self._lull(rec, t0)
        time.sleep(max(0.0, want - (time.monotonic() - t0)))
        rec["frozen_s"] = time.monotonic() - t0
        if not thaw:
            return
        self.draining.clear()
        self.sidecar.thaw()
        t_up, _ = self.sidecar.wait_serving(self.args.serve_s)
        rec["answers_after_thaw_s"] = None if t_up is None else t_up - t0 - rec["frozen_s"]
        if t_up is None:
            raise RuntimeError("the thawed sidecar does not answer Stats")

    def _kill(self, rec: dict[str, Any]) -> None:
        down = self.rng.uniform(*self.args.down_s)
        t_kill = time.monotonic()
        self.sidecar.kill()
        rec["killed"] = True
        self._lull(rec, t_kill - rec.get("frozen_s", 0.0))
        time.sleep(max(0.0, down - (time.monotonic() - t_kill)))
        rec["down_s"] = time.monotonic() - t_kill
        self.draining.clear()
        self.sidecar.spawn()
        t_up, st = self.sidecar.wait_serving(self.args.serve_s)
        if t_up is None:
            raise RuntimeError("the restarted sidecar did not serve")
        rec["restarted"] = True
        rec["serve_s"] = t_up - t_kill - rec["down_s"]
        rec["adoption"] = {"outcome": st.adoption.outcome, "blocks": st.adoption.adopted_blocks}
        # slots the dead instance had reserved: withheld until every worker rank reported
        # drained (at its first step after registering again), the engine living on
        rec["withheld"] = fd.slots(st)["withheld"]
        rec["register_s"] = None
        end = time.monotonic() + self.args.serve_s
        while time.monotonic() < end:  # the connector's own reconnect (default backoff)
            st = self.sidecar.stats(timeout_s=0.5)
            if st is not None and fd.slots(st)["live"] >= self.clients:
                rec["register_s"] = time.monotonic() - t_up
                break
            time.sleep(0.02)
        rec["withheld_free_s"] = None
        end = time.monotonic() + self.args.serve_s
        while time.monotonic() < end:
            st = self.sidecar.stats(timeout_s=0.5)
            if st is not None and fd.slots(st)["withheld"] == 0:
                rec["withheld_free_s"] = time.monotonic() - t_up
                break
            time.sleep(0.05)


# -- the negative control -----------------------------------------------------------------


def scribble(fd: int, rng) -> int:
    """Noise over the bytes of every committed slot of every namespace (each rank's region) of
    the pool memory `fd` (a pool file, or a tenant's memfd: one layout), found through the
    memory's own index (persist.py); the index itself is left intact, so the slots stay
    committed and visible. Returns the slots written."""
    import numpy as np
    from kvoffload_sidecar import persist

    written = 0
    size = os.fstat(fd).st_size
    buf = mmap.mmap(fd, size)
    try:
        geom = persist.geometry(size, max_namespaces=1, hugepages=False)
        header = persist.read_header(buf, geom)
        for part in range(geom.max_namespaces):
            layout = persist.read_namespace(buf, geom, part, header.generation)
            if not isinstance(layout, persist.NamespaceLayout):
                continue
            words = layout.record_bytes // 8
            at = layout.table_offset
            table = bytes(buf[at : at + layout.slot_count * layout.record_bytes])
            state = np.frombuffer(table, np.uint64).reshape(layout.slot_count, words)[:, 0]
            slot_bytes = layout.slot_bytes_per_rank
            for slot in np.flatnonzero(state >= persist.FIRST_SEQ):
                noise = (rng.standard_normal(slot_bytes // 4) * 4).astype(np.float32)
                for rank in range(layout.num_ranks):
                    at = layout.rank_offset(rank) + int(slot) * slot_bytes
                    buf[at : at + slot_bytes] = noise.tobytes()
                written += 1
    finally:
        buf.close()
    return written


class Scribbler(threading.Thread):
    """scribble() every `period_s` until stopped, over the memory `open_memory()` opens (an fd
    this thread closes)."""

    def __init__(self, open_memory, period_s: float, seed: int):
        super().__init__(name="scribbler", daemon=True)
        import numpy as np

        self.open_memory, self.period_s = open_memory, period_s
        self.rng = np.random.default_rng(seed)
        self.stop_event = threading.Event()
        self.passes = self.slots = 0
        self.error = ""

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                fd = self.open_memory()
                try:
                    self.slots += scribble(fd, self.rng)
                finally:
                    os.close(fd)
                self.passes += 1
            except Exception as e:  # noqa: BLE001 - reported; the control then proves nothing
                self.error = f"{type(e).__name__}: {e}"
                return
            self.stop_event.wait(self.period_s)


# -- node placement -----------------------------------------------------------------------


class NodeAgent(fd.Sidecar):
    """The pool of node placement, supervised as fd.Sidecar supervises a sidecar: a holder
    (kept for the whole run: it keeps the tenant memfd), a `kvoffload node-agent` beside it
    granting tenant `alpha` (--pool-size) to namespace `team-a`, and the kubelet stand-in
    (bench/node_standin.py) publishing one pod's volume. `socket` is that pod's `pool.sock`,
    through a short link (a pod mounts the volume at /var/run/kvoffload). A kill is the
    agent's; `spawn` starts it again on the same state: it re-binds the pod's sockets and
    adopts the tenant's index from the memfd the holder lends it again. Every boot's log is
    appended to `log_path`."""

    TENANT = "alpha"

    def __init__(self, root: Path, share_bytes: int, log_path: Path) -> None:
        import node_standin as standin

        self.root = root
        self.holder, holder_socket = standin.start_holder(root)
        pool = {
            "name": "node-pool",
            "tenants": [{"name": self.TENANT, "shareBytes": share_bytes, "namespaces": ["team-a"]}],
        }
        self.agent = standin.Agent(root, "--holder-socket", holder_socket, pool=pool)
        self.pod = standin.new_pod("team-a", "vllm-0", self.TENANT)
        self.kubelet: Any = None
        super().__init__([], "", log_path)
        self.cmd = self.agent.command()

    def spawn(self) -> None:
        import node_standin as standin

        self.agent.start()  # until its serving line
        self.proc = self.agent.proc
        if self.kubelet is None:  # published once: a restarted agent re-binds the pod
            self.kubelet = standin.Kubelet(self.root, self.agent.csi_socket)
            self.kubelet.publish(self.pod)
            self.socket = str(Path(self.kubelet.short(self.pod)) / "pool.sock")

    def _keep_log(self) -> None:
        with contextlib.suppress(OSError), open(self.log_path, "ab") as out:
            out.write(self.agent.log.read_bytes())

    def kill(self) -> None:
        super().kill()
        self._keep_log()

    def memory_fd(self) -> int:
        """The tenant's memfd as its pod gets it from `memory.sock` (read-write)."""
        from kvoffload_connector.common.node_memory import receive_tenant_memory

        fd, _ = receive_tenant_memory(str(Path(self.socket).parent / "memory.sock"), self.TENANT)
        return fd

    def pids(self) -> set[int]:
        return {p.pid for p in (self.proc, self.holder) if p is not None}

    def stop(self) -> None:
        import shutil

        super().stop()
        if self.proc is not None:
            self._keep_log()
        if self.kubelet is not None:
            self.kubelet.channel.close()
        if self.holder.poll() is None:
            self.holder.send_signal(signal.SIGTERM)
            try:
                self.holder.wait(10)
            except Exception:  # noqa: BLE001 - a holder that does not go is killed
                self.holder.kill()
        shutil.rmtree(self.root, ignore_errors=True)


# -- the reference engine -----------------------------------------------------------------


# -- the drill ----------------------------------------------------------------------------


def chunk_tokens(block: int, configured: int) -> int:
    """Tokens per pool chunk the connector will use (fitted to the block size as it does)."""
    from kvoffload_connector.common.config import default_chunk_tokens

    return -(-configured // block) * block if configured else default_chunk_tokens(block)


def gpu_blocks(args: argparse.Namespace, chunk: int) -> int:
    """Room for about two requests (`max_num_seqs` asks for more): the rest wait for blocks,
    their lookups answered. At least one max_model_len sequence, as vLLM requires."""
    block = args.block_size
    prompt = (args.doc_chunks + args.suffix_chunks) * chunk + max(1, chunk // 3)
    per_request = -(-(prompt + args.max_tokens) // block)
    return max(2 * per_request + 2, -(-args.max_model_len // block) + 1)


def chaos_stream(drill: fd.Drill, chaos: Chaos, args: argparse.Namespace) -> None:
    """--inflight requests of normal priority kept in the engine until the chaos ends, except
    in its lulls, plus the low-priority ones (see the module's doc); then drained."""
    next_low = time.monotonic() + args.low_period_s
    rng = random.Random(f"low-{args.seed}")
    while not chaos.done.is_set() or drill.inflight:
        feeding = not chaos.done.is_set() and not chaos.draining.is_set()
        lows = sum(1 for rid in drill.inflight if drill.requests[int(rid[1:])]["priority"])
        if feeding and args.low_max and lows < args.low_max and time.monotonic() >= next_low:
            # the others' queue empties into the running batch (at most --low-pause-highs of
            # them left); the scheduler then reaches the new low-priority request and asks the
            # pool (no room to run it) before the others come back, ahead of it
            end = time.monotonic() + 2.0
            while len(drill.inflight) - lows > args.low_pause_highs and time.monotonic() < end:
                if chaos.draining.is_set():
                    break
                drill.step()
            # a document the others ask for now and then, not the hottest: in the pool when it
            # asks, evicted (its slots taken by other keys) while it waits
            drill.add(doc=rng.randrange(min(2, args.docs - 1), args.docs), priority=1)
            for _ in range(3):  # the engine core schedules it alone among the waiting ones
                drill.step()
            lows += 1
            next_low = time.monotonic() + args.low_period_s
        if feeding:
            while len(drill.inflight) - lows < args.inflight:
                drill.add()
        if drill.inflight:
            drill.step()
        else:  # a lull with nothing left to run
            drill.last_progress = time.monotonic()
            time.sleep(0.005)


def counters_now() -> dict[str, float]:
    time.sleep(0.3)  # the last steps' stats reach this process's registry
    return fd.connector_counters()


def phase_summary(
    requests: list[dict[str, Any]], ref: list[list[int]] | None, max_tokens: int
) -> dict[str, Any]:
    """Per phase: requests served, failed (no output, or not max_tokens tokens), compared with
    the reference, differing tokens and requests, cached tokens."""
    out: dict[str, Any] = {}
    for phase in PHASES:
        idx = [i for i, r in enumerate(requests) if r["phase"] == phase]
        rows = [requests[i] for i in idx]
        served = [r for r in rows if r["tokens"] is not None]
        failed = [r for r in rows if r["tokens"] is None or len(r["tokens"]) != max_tokens]
        diff_tokens = diff_requests = compared = 0
        examples = []
        if ref is not None:
            for i in idx:
                got = requests[i]["tokens"]
                if got is None:
                    continue
                want = ref[i]
                compared += 1
                d = sum(1 for a, b in zip(got, want, strict=False) if a != b)
                d += abs(len(got) - len(want))
                diff_tokens += d
                diff_requests += 1 if d else 0
                if d and len(examples) < 3:
                    r = requests[i]
                    examples.append(
                        {k: r.get(k) for k in ("i", "doc", "priority", "ttft_s", "cached")}
                        | {"got": got, "want": want}
                    )
        out[phase] = {
            "requests": len(rows),
            "served": len(served),
            "failed": len(failed),
            "compared": compared,
            "differing_tokens": diff_tokens if ref is not None else None,
            "differing_requests": diff_requests if ref is not None else None,
            "cached_tokens": sum(r.get("cached", 0) for r in served),
            # queued + prefill: how long requests waited (a waiting one may hold an answer)
            "ttft_s": spread(r["ttft_s"] for r in served if "ttft_s" in r),
            "low_priority": sum(1 for r in rows if r.get("priority")),
            "low_priority_ttft_s": spread(
                r["ttft_s"] for r in served if r.get("priority") and "ttft_s" in r
            ),
            "differing_examples": examples,
        }
    return out


def section(rep: dict[str, Any], placement: str) -> dict[str, Any]:
    """Where a placement's run reports: pod at the top of the report, node under `node`."""
    return rep if placement == "pod" else rep.setdefault(placement, {})


def start_pool(args: argparse.Namespace, placement: str, work_dir: Path) -> fd.Sidecar:
    """The placement's pool, serving: a sidecar (every timing shipped) on a pool file, or a
    node agent beside its holder with one pod published (NodeAgent)."""
    from kvoffload_cli.sidecar_child import kvoffload_command, memory_dir
    from kvoffload_sidecar.units import parse_size

    if placement == "pod":
        pool_dir = memory_dir("kvo-chaos-")
        args.pool_dir_resolved = str(pool_dir)
        socket = str(work_dir / "pool.sock")
        cmd = [*kvoffload_command(), "sidecar", "--pool-size", args.pool_size]
        cmd += ["--pool-dir", str(pool_dir), "--socket", socket]  # every timing shipped
        pool = fd.Sidecar(cmd, socket, work_dir / "sidecar.log", env=args.sidecar_env)
    else:
        import node_standin as standin

        root = standin.make_root()
        pool = NodeAgent(root, parse_size(args.pool_size), work_dir / "node-agent.log")
    pool.spawn()
    if pool.wait_serving(60)[0] is None:
        raise RuntimeError(f"the {placement} pool did not serve")
    return pool


def open_memory(args: argparse.Namespace, pool: fd.Sidecar):
    """What the scribbler writes over: the pool file, or the tenant's memfd."""
    if isinstance(pool, NodeAgent):
        return pool.memory_fd
    path = Path(args.pool_dir_resolved) / "pool-0.shm"
    return lambda: os.open(path, os.O_RDWR)


def run_placement(
    args: argparse.Namespace,
    placement: str,
    work_dir: Path,
    kwargs: dict[str, Any],
    sub: dict[str, Any],
    keep: set[int],
) -> list[dict[str, Any]]:
    """One engine with kvoffload over the placement's pool, the phases; fills `sub` as it goes
    (a failure part-way still reports what happened); the requests, for the reference."""
    from vllm import LLM

    pool = start_pool(args, placement, work_dir)
    sub["sidecar_command"] = pool.cmd
    try:
        t0 = time.monotonic()
        kv = fd.kv_transfer_config(
            argparse.Namespace(
                socket=pool.socket,
                chunk=args.chunk,
                extra_config=dict(args.extra_config or {}, **PLACEMENT_CONFIG[placement]),
            )
        )
        sub["connector_extra_config"] = kv["kv_connector_extra_config"]
        llm = LLM(**kwargs, kv_transfer_config=kv)
        vc = llm.llm_engine.vllm_config
        assert int(vc.cache_config.block_size) == args.block_size, vc.cache_config.block_size
        chunk = chunk_tokens(args.block_size, args.chunk)
        vocab = int(vc.model_config.get_vocab_size())
        suffix = args.suffix_chunks * chunk + max(1, chunk // 3)
        # each placement its own prompts (another seed): the node run starts on a cold pool
        seed = args.seed + (1000 if placement == "node" else 0)
        work = fd.Workload(seed, args.docs, args.doc_chunks, chunk, vocab, suffix, args.hot)
        sub["engine"] = {
            "start_s": time.monotonic() - t0,
            "chunk_tokens": chunk,
            "num_gpu_blocks": vc.cache_config.num_gpu_blocks,
            "prompt_tokens": args.doc_chunks * chunk + suffix,
            "kwargs": {k: v for k, v in kwargs.items() if k != "model"},
        }
        if args.engine_nice:
            fd.renice_engine(args.engine_nice, keep=keep | pool_pids(pool))
        drill = fd.Drill(llm, args, work)

        def on_stall() -> None:
            pool.stop()

        fd.watchdog(drill, args.stall_s, on_stall)
        counters: dict[str, dict[str, float]] = {}
        phase_s: dict[str, float] = {}

        def phase(name: str, more) -> None:
            drill.phase = name
            t = time.monotonic()
            more()
            fd.settle(pool)
            phase_s[name] = time.monotonic() - t
            counters[name] = counters_now()

        counters["start"] = fd.connector_counters()
        warm = args.warmup or 2 * args.docs
        phase("warmup", lambda: drill.stream(lambda: len(drill.requests) < warm))
        st = pool.stats()
        clients = fd.slots(st)["live"] if st is not None else 0
        sub["clients"] = clients
        if clients < 1:
            raise RuntimeError(f"the connector never registered with the {placement} pool")

        if "chaos" in args.phases:
            chaos = Chaos(pool, args, clients)
            sub["chaos"] = chaos.records
            sub["t_chaos"] = time.monotonic()
            chaos.start()
            phase("chaos", lambda: chaos_stream(drill, chaos, args))
            chaos.join()
            if chaos.error:
                raise RuntimeError(f"chaos: {chaos.error}")
        if "recover" in args.phases:
            end = time.monotonic() + args.recover_s
            phase("recover", lambda: drill.stream(lambda: time.monotonic() < end))
        if "scribble" in args.phases:
            scribbler = Scribbler(open_memory(args, pool), args.scribble_period_s, args.seed)
            scribbler.start()
            end = time.monotonic() + args.scribble_s
            phase("scribble", lambda: drill.stream(lambda: time.monotonic() < end))
            scribbler.stop_event.set()
            scribbler.join()
            sub["scribbled"] = {
                "passes": scribbler.passes,
                "slots": scribbler.slots,
                "error": scribbler.error,
            }
        sub["phase_s"] = phase_s
        sub["counters"] = counters
        order = ["start", *[p for p in PHASES if p in counters]]
        sub["hits"] = {
            p: {
                k: counters[p].get(k, 0.0) - counters[prev].get(k, 0.0)
                for k in ("hit_tokens", "loaded_bytes", "failed_loads", "stored_bytes")
            }
            for prev, p in zip(order, order[1:], strict=False)
        }
        st = pool.stats()
        sub["sidecar_at_end"] = fd.slots(st) if st is not None else {}
        drill.last_progress = float("inf")  # the watchdog: no more steps
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        drill.llm = drill.engine = None
        del llm
        gc.collect()
        return drill.requests
    finally:
        pool.stop()
        if placement == "pod":
            import shutil

            shutil.rmtree(args.pool_dir_resolved, ignore_errors=True)
        if args.sidecar_log:  # every boot's log, each placement's own file
            import shutil

            name = args.sidecar_log if placement == "pod" else f"{args.sidecar_log}.{placement}"
            with contextlib.suppress(OSError):
                shutil.copyfile(pool.log_path, name)


PLACEMENT_CONFIG = {"pod": {}, "node": {"placement": "node"}}


def pool_pids(pool: fd.Sidecar) -> set[int]:
    return pool.pids() if isinstance(pool, NodeAgent) else {pool.proc.pid if pool.proc else -1}


def run_drill(args: argparse.Namespace, work_dir: Path, rep: dict) -> None:
    """The reference engine, then each placement's engine and phases in turn (one reference
    start for all), the comparison; fills `rep` as it goes."""
    os.environ.update(args.engine_env)  # the engine core and workers inherit them
    chunk = chunk_tokens(args.block_size, args.chunk)
    args.gpu_blocks = args.gpu_blocks or gpu_blocks(args, chunk)
    kwargs = fd.engine_kwargs(args)
    # The reference: the same engine with room for a big batch (one pass over every prompt;
    # greedy tokens do not depend on the batch), without the --engine-env variables.
    ref_kwargs = dict(kwargs, max_num_seqs=32, num_gpu_blocks_override=32 * args.gpu_blocks)
    if args.low_max:
        kwargs["scheduling_policy"] = "priority"
    ref_env_clean = {k: os.environ.pop(k) for k in args.engine_env if k in os.environ}
    reference = fd.Reference(ref_kwargs, work_dir, args.max_tokens)
    os.environ.update(ref_env_clean)
    try:
        runs: dict[str, list[dict[str, Any]]] = {}
        for placement in args.placements:
            sub = section(rep, placement)
            runs[placement] = run_placement(
                args, placement, work_dir, kwargs, sub, keep={reference.proc.pid}
            )
        t_ref = time.monotonic()
        prompts = [r["prompt"] for reqs in runs.values() for r in reqs]
        ref_all = reference.generate(prompts, args.reference_timeout_s)
        rep["reference_s"] = time.monotonic() - t_ref
        at = 0
        for placement, requests in runs.items():
            sub = section(rep, placement)
            ref = ref_all[at : at + len(requests)]
            at += len(requests)
            sub["requests"] = len(requests)
            sub["phases"] = phase_summary(requests, ref, args.max_tokens)
            t_chaos = sub.get("t_chaos", 0.0)
            sub["low_priority"] = [
                {
                    "i": r["i"],
                    "doc": r["doc"],
                    "t": round(r["t_add"] - t_chaos, 3),
                    "waited_s": r.get("ttft_s"),
                    "cached": r.get("cached"),
                    "differing": sum(
                        1 for a, b in zip(r["tokens"] or [], ref[r["i"]], strict=False) if a != b
                    ),
                }
                for r in requests
                if r.get("priority")
            ]
            sub["per_doc_requests"] = {
                str(d): sum(1 for r in requests if r["doc"] == d) for d in range(args.docs)
            }
    finally:
        reference.stop()


def verdict(rep: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """What makes the exit status 1 (empty: the drill passed)."""
    bad = []
    if rep.get("error"):
        bad.append(rep["error"])
    for placement in args.placements:
        phases = section(rep, placement).get("phases", {})
        for p in FAULTLESS:
            s = phases.get(p)
            if p in args.phases and s is not None and (s["failed"] or s["differing_tokens"]):
                bad.append(
                    f"{placement} {p}: {s['failed']} failed, {s['differing_tokens']} tokens differ"
                )
        s = phases.get("scribble")
        if "scribble" in args.phases and (s is None or not s["differing_tokens"]):
            bad.append(f"{placement} scribble: no token differs (cannot see wrong bytes)")
    return bad


def summary_rows(rep: dict[str, Any], placements: list[str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for placement in placements:
        for row in placement_rows(section(rep, placement)):
            rows.append(dict(row, measure=f"{placement}: {row['measure']}"))
    return rows


def placement_rows(rep: dict[str, Any]) -> list[dict[str, Any]]:
    events = rep.get("chaos", [])
    rows: list[dict[str, Any]] = []
    for kind in EVENTS:
        evs = [e for e in events if e["kind"] == kind]
        rows.append({"measure": f"events: {kind}", "value": len(evs)})
    frozen = [e["frozen_s"] for e in events if "frozen_s" in e]
    down = [e["down_s"] for e in events if "down_s" in e]
    for name, vals in (("frozen", frozen), ("down", down)):
        sp = spread(vals)
        rows.append({"measure": f"{name} s", "value": sp["n"], "min": sp["min"], "max": sp["max"]})
    rows.append(
        {
            "measure": "events with pins held / stores open",
            "value": sum(1 for e in events if e["before"].get("pinned")),
            "unit": str(sum(1 for e in events if e["before"].get("reserved"))),
        }
    )
    kills = [e for e in events if e.get("killed")]
    freed = spread(e["withheld_free_s"] for e in kills if e.get("withheld_free_s") is not None)
    never = sum(1 for e in kills if e.get("withheld_free_s") is None)
    rows.append(
        {
            "measure": "slots withheld after kills (freed s)",
            "value": sum(e.get("withheld") or 0 for e in kills),
            "min": freed["min"],
            "max": freed["max"],
            "unit": f"{never} kills never freed them",
        }
    )
    lows = rep.get("low_priority", [])
    waits = spread(x["waited_s"] for x in lows if x["waited_s"] is not None)
    rows.append(
        {
            "measure": "low-priority requests (waited s)",
            "value": len(lows),
            "min": waits["p50"],
            "max": waits["max"],
            "unit": f"{sum(1 for e in events if e['drain'])} lulls; p50 / max wait",
        }
    )
    for p, s in rep.get("phases", {}).items():
        h = rep.get("hits", {}).get(p, {})
        rows.append(
            {
                "measure": f"phase {p}",
                "value": s["served"],
                "min": s["differing_tokens"],
                "max": h.get("hit_tokens"),
                "unit": "served / differing tokens / pool-hit tokens",
            }
        )
    return rows


def drill_main(args: argparse.Namespace) -> int:
    import shutil

    from kvoffload_cli.sidecar_child import memory_dir

    work_dir = memory_dir("kvo-chaos-work-")
    rep: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k not in ("extra_config",)},
        "defaults": sidecar_defaults(),
    }
    t0 = time.monotonic()
    try:
        run_drill(args, work_dir, rep)
    except Exception as e:  # noqa: BLE001 - reported, exit status 1
        import traceback

        traceback.print_exc()
        rep["error"] = f"{type(e).__name__}: {e}"
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    rep["wall_s"] = time.monotonic() - t0
    bad = verdict(rep, args)
    rep["ok"], rep["problems"] = not bad, bad
    report(
        f"chaos drill: the {' and '.join(args.placements)} pool frozen and killed at the shipped"
        " defaults",
        summary_rows(rep, args.placements),
        args.out,
        extra=rep,
        columns=["measure", "value", "min", "max", "unit"],
    )
    print(f"wall {rep['wall_s']:.0f} s; " + ("ok" if not bad else "; ".join(bad)))
    return 0 if not bad else 1


def env_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected VAR=VALUE, got {text!r}")
    return name, value


def float_range(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition(",")
    return float(lo), float(hi or lo)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    fd.engine_arguments(ap)
    ap.set_defaults(
        block_size=32,
        chunk=64,
        max_model_len=512,
        docs=12,
        doc_chunks=3,
        max_tokens=8,
        inflight=6,
        max_num_seqs=4,
        dtype="float32",
    )
    ap.add_argument("--hot", type=float, default=1.0, help="document skew (Workload.hot)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "chaos_drill.json"))
    ap.add_argument("--pool-size", default="2Mi", help="far below the documents + suffixes")
    ap.add_argument("--phases", default=",".join(PHASES), help="which of " + ",".join(PHASES))
    ap.add_argument(
        "--placement",
        default="pod",
        help="pod (a sidecar), node (a node agent and its holder), or pod,node: one engine "
        "after the other, one reference for both",
    )
    ap.add_argument("--warmup", type=int, default=0, help="warm-up requests; 0: 2 per document")
    ap.add_argument("--chaos-s", type=float, default=60.0, help="events start within this")
    ap.add_argument(
        "--events", type=int, default=0, help="at most this many events (0: as --chaos-s allows)"
    )
    ap.add_argument("--gap-s", type=float_range, default=(1.0, 4.0), help="LO,HI between events")
    ap.add_argument("--freeze-s", type=float_range, default=(2.5, 5.5), help="LO,HI SIGSTOP")
    ap.add_argument("--down-s", type=float_range, default=(2.3, 4.0), help="LO,HI killed")
    ap.add_argument("--low-period-s", type=float, default=1.0, help="a low-priority request")
    ap.add_argument("--low-max", type=int, default=3, help="low-priority ones at once (0: none)")
    ap.add_argument(
        "--low-pause-highs", type=int, default=2, help="the others' pause: until this few are left"
    )
    ap.add_argument(
        "--drain-after-s", type=float, default=1.2, help="a lull starts this long into its fault"
    )
    ap.add_argument("--recover-s", type=float, default=5.0)
    ap.add_argument("--scribble-s", type=float, default=6.0)
    ap.add_argument("--scribble-period-s", type=float, default=0.2)
    ap.add_argument("--serve-s", type=float, default=30.0, help="a restart must serve within")
    ap.add_argument("--reference-timeout-s", type=float, default=300.0)
    ap.add_argument("--sidecar-log", default="", help="keep the sidecar's log (all boots) here")
    ap.add_argument("--engine-env", type=env_pair, action="append", default=[])
    ap.add_argument("--sidecar-env", type=env_pair, action="append", default=[])
    args = ap.parse_args()
    args.phases = [p for p in args.phases.split(",") if p]
    unknown = set(args.phases) - set(PHASES)
    if unknown or "warmup" not in args.phases:
        ap.error(f"--phases: warmup and any of {PHASES}, not {sorted(unknown)}")
    args.placements = [p for p in args.placement.split(",") if p]
    if not args.placements or set(args.placements) - set(PLACEMENT_CONFIG):
        ap.error(f"--placement: pod, node or pod,node, not {args.placement!r}")
    args.engine_env, args.sidecar_env = dict(args.engine_env), dict(args.sidecar_env)
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

    def terminated(*_: object) -> None:
        raise SystemExit(143)  # unwinds drill_main: its `finally` stops the sidecar

    signal.signal(signal.SIGTERM, terminated)
    return drill_main(args)


if __name__ == "__main__":
    sys.exit(main())
