"""The slot protocol as a state machine over schedules (hypothesis stateful testing).

One engine (its scheduler and one worker rank) and another engine of the same model share a
sidecar's pool of 4 slots. The checker interleaves what the protocol must survive: requests
arriving and being admitted (or left waiting with their lookup answer), engine steps, the RPC
threads' calls, each copy as its own step (early, late, after a session loss, a restart or an
engine's death), sessions lost to deadlines, reconnects, time passing the detach grace (the
reaper), eviction pressure from the other engine (whose copies may also lag, or die with it),
engines dying (the kernel drops their locks) and starting again, sidecar restarts that adopt
the pool file, late commits naming a previous sidecar instance, cache resets.

The invariants are on bytes, not on bookkeeping: every store writes its chunk's content (a
fingerprint of the prompt prefix it belongs to) into the pool file, and
- class 1 ("loads"): every load the worker reports done copied exactly the bytes a recompute
  would give (else it must be reported failed);
- class 2 ("slots"): every committed key's slot holds that key's bytes.

`mode` picks the invariants: "loads" also keeps store copies out of slots whose reservation
the current sidecar no longer knows (so a counterexample is a class-1 one), "slots" checks
only committed slots, "all" checks both with nothing held back. `broken` switches protocol
guarantees off (shim.Broken) for the negative controls.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import torch
from hypothesis import strategies as st
from hypothesis import target
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from kvoffload_connector.common.config import parse_extra_config
from kvoffload_connector.common.errors import PoolUnavailable
from kvoffload_connector.common.keys import build_spec, chunk_keys, in_epoch
from kvoffload_connector.scheduler.offload_scheduler import OffloadScheduler
from kvoffload_connector.worker import pool_binding
from kvoffload_connector.worker.offload_worker import OffloadWorker
from kvoffload_connector.worker.pool_view import PoolView
from kvoffload_connector.worker.transfer import Direction
from kvoffload_sidecar.pool import PoolSettings

from tests.connector.vllm_fakes import (
    BS,
    CHUNK,
    BlockPool,
    KVBlocks,
    KVCacheManager,
    Request,
    SchedOut,
)
from tests.model.shim import (
    Broken,
    FakeClock,
    InProcessClient,
    ManualRpc,
    OtherEngine,
    PendingCopy,
    Sidecar,
    StepEngine,
    break_worker,
)
from tests.sidecar.pool_invariants import check_invariants

CHUNK_BLOCKS = CHUNK // BS
BLOCK_BYTES = 512
SLOT_BYTES = CHUNK_BLOCKS * BLOCK_BYTES  # one chunk of one group, one rank
POOL_BYTES = 20480  # 4 slots of 1 KiB with the slot table
SLOTS = 4
PROMPT_TOKENS = 130  # 4 full blocks: 2 chunks, both usable by a hit (the n-1 rule)
PROMPT_BLOCKS = PROMPT_TOKENS // BS + 1
NPROMPTS = 2
NFILLERS = 6  # keys only the other engine stores
MAX_LIVE = 4  # requests in the engine at once
MAX_RESTARTS = 2  # sidecar restarts per schedule
MAX_RESETS = 1  # cache resets per schedule
MAX_ENGINE_DEATHS = 1  # this engine's deaths (and restarts) per schedule
MAX_OTHER_DEATHS = 1
OTHER_ENGINE = 0x07E4  # the other engine's key (this engine's scheduler draws its own)
GRACE_S = PoolSettings.detach_grace_s  # the shipped detach grace
GPU_BLOCKS = 1 + MAX_LIVE * PROMPT_BLOCKS + 8

SPEC = build_spec(
    model="model-checker",
    dtype="bfloat16",
    kv_layout="model-checker/packed",
    block_size=BS,
    chunk_blocks=CHUNK_BLOCKS,
    tp_size=1,
    hash_algo="sha256",
    group_specs=["full"],
)


def block_content(block_hash: bytes) -> bytes:
    """A GPU block's KV bytes as computing its prefix gives them: its hash, repeated."""
    return (bytes(block_hash) * (BLOCK_BYTES // len(block_hash) + 1))[:BLOCK_BYTES]


def prompt(p: int) -> list[int]:
    return list(range(p * 1000, p * 1000 + PROMPT_TOKENS))


def filler_key(i: int) -> bytes:
    return hashlib.sha256(b"filler-%d" % i).digest() + (0).to_bytes(4, "big")


@dataclass
class Req:
    rid: str
    p: int
    req: Request
    state: str = "waiting"  # waiting | loading | prefill | running
    blocks: list = field(default_factory=list)
    hit: int = 0  # tokens the load brings


class SlotProtocol(RuleBasedStateMachine):
    mode: ClassVar[str] = "all"  # "loads" (class 1), "slots" (class 2), "all"
    broken: ClassVar[Broken] = Broken.NONE  # guarantees switched off (negative controls)

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvo-model-", dir=_tmpfs()))
        self.clock = FakeClock()
        settings = PoolSettings(pool_size=POOL_BYTES, pool_dir=self.dir, prefault=False)
        self.sidecar = Sidecar(settings, self.clock, self.broken)
        self.sidecar.start()
        self.truth: dict[bytes, bytes] = {}  # pool key -> the bytes its slot must hold
        self.names: dict[bytes, str] = {}  # pool key, or a slot's content -> a short name
        self.epochs: list[bytes | None] = [None]
        self.loads_checked = 0  # loads reported done whose bytes were checked
        self.loads_failed = 0  # loads reported failed (vLLM recomputes)
        self.copies_run = 0  # copy steps that found a copy to run
        self.stale_commits = 0
        self.refused_commits = 0  # late commits (stale_commit) the sidecar refused
        self.engine_deaths = 0
        self.faults = True  # start(faults=): the fault rules are enabled
        self.other_deaths = 0
        self.best_load = self.best_store = 0  # search guidance (guide_search)
        for i in range(NFILLERS):
            k = filler_key(i)
            self._know(k, (k * (SLOT_BYTES // len(k) + 1))[:SLOT_BYTES], f"f{i}")
        for p in range(NPROMPTS):
            self._know_prompt(p, None)
        self._boot_engine()
        # the other engine: stores with its copies landing at once, or later (other_copy)
        self.other = OtherEngine(self.sidecar, OTHER_ENGINE, SPEC, SLOT_BYTES)
        self.other_pending: list[tuple[int, list[tuple[int, bytes]]]] = []
        assert self.other.ready(), "the other engine did not register"
        region = self.other.client.registration.regions[0]
        self.view = PoolView.open(region.path, region.offset, region.slot_bytes, region.slot_count)

    def _boot_engine(self) -> None:
        """A vLLM engine starts: its worker registers and maps the real pool file (its engine
        copies on the checker's word), its scheduler joins from the worker's first report."""
        self.gpu: dict[int, bytes] = {}  # GPU block id -> its bytes
        self.reqs: dict[str, Req] = {}
        self.sched: dict[str, int] = {}  # the next step's scheduled tokens per request
        self.n_reqs = getattr(self, "n_reqs", 0)
        cfg = parse_extra_config(
            {
                "chunk_size": CHUNK,
                "mode": "eager",
                "register_wait_ms": 0,
                "ready_wait_ms": 0,
                "load_mode": "async",
                "inline_lookup": False,
            },
            BS,
        )
        vllm_config = SimpleNamespace(
            parallel_config=SimpleNamespace(
                tensor_parallel_size=1, pipeline_parallel_size=1, world_size=1
            ),
            cache_config=SimpleNamespace(block_size=BS),
        )
        w = self.worker = OffloadWorker(cfg, vllm_config=vllm_config, kv_cache_config=None, rank=0)
        w._rpc.close()
        w._rpc = ManualRpc()
        w.client.close()
        w.client = self.worker_client = InProcessClient(self.sidecar, "engine/rank-0")
        w.device = torch.device("cpu")
        w.layout = SimpleNamespace(slot_bytes=SLOT_BYTES, tag="model-checker", gpu=self.gpu)
        w.spec = SPEC
        break_worker(w, self.broken)
        w._apply(w.client.register(SPEC, 1, SLOT_BYTES))  # what register_kv_caches does
        self.sched_client = InProcessClient(self.sidecar, "engine/scheduler")
        s = self.scheduler = OffloadScheduler(
            cfg, block_size=BS, num_groups=1, world_size=1, client=self.sched_client,
            clock=self.clock,
        )  # fmt: skip
        s._rpc.close()
        s._rpc = ManualRpc()
        self.block_pool = BlockPool(GPU_BLOCKS)
        self.kv = KVCacheManager(self.block_pool)
        s.bind(self.kv)
        s.update_connector_output(w.report())
        s._rpc.run_all()
        assert self.sched_client.connected and s._usable(), "the scheduler did not join"

    def teardown(self) -> None:
        if currently_in_test_context():
            target(float(self.best_load), label="load in flight whose slot was rewritten")
            target(float(self.best_store), label="store copy whose slot went to another")
        self.sidecar.kill()
        self.other.release()
        eng = self.worker.engine
        if eng is not None:
            eng.shutdown()
        self.worker._release_engine_lock()
        for v in (self.view, self.worker.pool, self.worker.slot_versions):
            if v is not None:
                v.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- ground truth ---------------------------------------------------------------------
    def _know(self, key: bytes, content: bytes, name: str) -> None:
        self.truth[key] = content
        self.names[key] = name
        self.names.setdefault(content, name)

    def _know_prompt(self, p: int, epoch: bytes | None) -> list[bytes]:
        hashes = Request("x", prompt(p)).block_hashes
        keys = in_epoch(chunk_keys(hashes, CHUNK_BLOCKS, 0, 2), epoch)
        e = self.epochs.index(epoch) if epoch in self.epochs else len(self.epochs)
        for c, k in enumerate(keys):
            content = b"".join(block_content(h) for h in hashes[c * 2 : c * 2 + 2])
            self._know(k, content, f"p{p}c{c}" + (f"@e{e}" if e else ""))
        return keys

    def _name(self, data: bytes) -> str:
        if data in self.names:
            return self.names[data]
        return "zeros" if not any(data) else "unknown bytes"

    @property
    def pool(self):
        return self.sidecar.pool

    # -- the engine -----------------------------------------------------------------------
    @precondition(lambda self: len(self.reqs) < MAX_LIVE)
    @rule(p=st.integers(0, NPROMPTS - 1))
    def arrive(self, p: int) -> None:
        """A request for prompt p arrives (vLLM's waiting queue)."""
        rid = f"r{self.n_reqs}"
        self.n_reqs += 1
        self.reqs[rid] = Req(rid, p, Request(rid, prompt(p)))

    def _try_admit(self, r: Req) -> None:
        s = self.scheduler
        n, _ = s.get_num_new_matched_tokens(r.req, 0)
        if n is None:
            return  # its lookup is out: asked again next step
        if self.block_pool.get_num_free_blocks() < PROMPT_BLOCKS:
            return  # no room: it waits, holding its answer
        r.blocks = self.block_pool.allocate(PROMPT_BLOCKS)
        self.kv.req_blocks[r.rid] = [r.blocks]
        s.update_state_after_alloc(r.req, KVBlocks((r.blocks,)), n)
        if n > 0:
            r.state, r.hit = "loading", n
        else:
            r.state = "prefill"
            self.sched[r.rid] = PROMPT_TOKENS

    @initialize(warm=st.sampled_from([0, None, 1]), stage=st.integers(0, 4), faults=st.booleans())
    def start(self, warm: int | None, stage: int, faults: bool = True) -> None:
        """Where a schedule starts (each stage runs the rules it names): the other engine
        stored prompt `warm` before this engine's first request (or none); then, by `stage`,
        1: a request for it arrived and vLLM asked about it once (its lookup answered, the
        request waiting with the answer); 2: vLLM admitted it (a hit: its load job is with the
        worker, the copy not run; a miss: computed, its store's reservation queued); 3: the
        reservation was answered and the store job went to the worker, its copy not run; 4: then
        the sidecar restarted and the clients registered again (the copy still to run).
        `faults`: deaths, restarts, resets, late commits and reconnects are enabled (swarm
        testing by family: an example without them spends its steps on the sessions, the
        reaper, eviction and the copies)."""
        self.faults = faults
        if warm is not None:
            self.other_store([NFILLERS + 2 * warm, NFILLERS + 2 * warm + 1])
        if stage >= 1:
            self.arrive(warm or 0)
            self.admit(0, catch_up=True)
        if stage >= 2:
            self.admit(0, catch_up=False)
        if stage >= 3:
            self.rpc("scheduler")
            self.step(admit=False, catch_up=False)
        if stage >= 4:
            self.restart_sidecar(rejoin=True)

    @precondition(lambda self: any(r.state == "waiting" for r in self.reqs.values()))
    @rule(i=st.integers(0, MAX_LIVE - 1), catch_up=st.booleans())
    def admit(self, i: int, catch_up: bool) -> None:
        """vLLM schedules a step with the i-th waiting request at the head of its queue."""
        waiting = [r for r in self.reqs.values() if r.state == "waiting"]
        self._try_admit(waiting[i % len(waiting)])
        self.step(admit=False, catch_up=catch_up)

    @rule(admit=st.just(False), catch_up=st.booleans())
    def step(self, admit: bool, catch_up: bool) -> None:
        """One engine step: vLLM asks about its waiting requests (admit), the scheduler builds
        the step's metadata, the worker submits loads, the forward computes, the worker submits
        stores, polls its copies and reports; requests whose loads finished get scheduled.
        `catch_up`: the RPC threads run what the step queued before the next rule."""
        s, w = self.scheduler, self.worker
        if admit:
            for r in list(self.reqs.values()):
                if r.state == "waiting":
                    self._try_admit(r)
        scheduled, self.sched = self.sched, {}
        for rid in scheduled:  # vLLM's computed tokens before this step's forward
            self.reqs[rid].req.num_computed_tokens = self.reqs[rid].hit
        meta = s.build_connector_meta(SchedOut(dict(scheduled)))
        w.start_load_kv(meta)
        for rid in scheduled:  # the forward: the rest of the prompt, computed
            r = self.reqs[rid]
            hashes = r.req.block_hashes
            for b in range(r.hit // BS, len(hashes)):
                self.gpu[r.blocks[b].block_id] = block_content(hashes[b])
            r.req.num_computed_tokens = PROMPT_TOKENS
            r.state = "running"
        w.wait_for_save(meta)
        recving, failed, _ = w.transfer_results()
        w.take_failed_layered_blocks()
        s.update_connector_output(w.report())
        for rid in recving:
            r = self.reqs.get(rid)
            if r is None or r.state != "loading":
                continue
            if rid in failed:  # vLLM recomputes the whole prompt
                r.hit = 0
                self.loads_failed += 1
            else:
                self._check_load(r)
            self.sched[rid] = PROMPT_TOKENS - r.hit
            r.state = "prefill"
        if catch_up:
            s._rpc.run_all()
            w._rpc.run_all()

    def _check_load(self, r: Req) -> None:
        """Class 1: a load reported done copied what a recompute gives, block by block."""
        self.loads_checked += 1
        if self.mode == "slots":
            return
        hashes = r.req.block_hashes
        for b in range(r.hit // BS):
            got = self.gpu.get(r.blocks[b].block_id, b"")
            want = block_content(hashes[b])
            assert got == want, (
                f"class 1: load of {r.rid} (prompt p{r.p}) reported done, block {b} holds "
                f"{self._block_name(got)} instead of its own bytes"
            )

    def _block_name(self, got: bytes) -> str:
        for content, name in self.names.items():
            if got and got in (content[:BLOCK_BYTES], content[BLOCK_BYTES:]):
                return f"bytes of {name}"
        return "zeros" if not any(got) else "unknown bytes"

    @precondition(lambda self: any(r.state in ("running", "waiting") for r in self.reqs.values()))
    @rule(i=st.integers(0, MAX_LIVE - 1))
    def finish(self, i: int) -> None:
        """A running request finishes (or a waiting one is aborted): vLLM frees its blocks."""
        live = [r for r in self.reqs.values() if r.state in ("running", "waiting")]
        r = live[i % len(live)]
        self.scheduler.request_finished(r.req, ([b.block_id for b in r.blocks],))
        if r.blocks:
            self.block_pool.free_blocks(r.blocks)
        self.kv.req_blocks.pop(r.rid, None)
        del self.reqs[r.rid]

    @precondition(lambda self: self.faults and len(self.epochs) <= MAX_RESETS)
    @rule()
    def reset_cache(self) -> None:
        """vLLM resets the connector's cache (new weights): a new key epoch."""
        self.scheduler.reset_cache()
        self.epochs.append(self.scheduler._key_epoch)
        for p in range(NPROMPTS):
            self._know_prompt(p, self.scheduler._key_epoch)

    @precondition(lambda self: self.faults and self.engine_deaths < MAX_ENGINE_DEATHS)
    @rule()
    def engine_dies(self) -> None:
        """The engine's processes exit (a crash, OOM, a pod restart of vLLM alone): its copies
        stop, the kernel drops its workers' locks, its sessions end; a new engine (a new
        engine key) starts. Its open reservations go once the reaper finds no lock."""
        self.engine_deaths += 1
        w = self.worker
        if isinstance(w.engine, StepEngine):
            w.engine.pending.clear()  # a dead process copies nothing more
        w._release_engine_lock()  # what the kernel does at exit
        for v in (w.pool, w.slot_versions):
            if v is not None:
                v.close()
        for c in (self.worker_client, self.sched_client):
            c.lose_session()
        self._boot_engine()

    # -- background calls and copies ------------------------------------------------------
    @precondition(lambda self: self.scheduler._rpc.queue or self.worker._rpc.queue)
    @rule(who=st.sampled_from(["scheduler", "worker"]))
    def rpc(self, who: str) -> None:
        """An RPC thread runs what is queued: the scheduler's (lookups, reservations,
        releases, aborts, its reconnect) or the worker's (commits, its re-registration)."""
        (self.scheduler if who == "scheduler" else self.worker)._rpc.run_all()

    def _copied(self) -> bool:
        """Some copy ran and was not reported yet."""
        eng = self.worker.engine
        return isinstance(eng, StepEngine) and any(p.copied for p in eng.pending.values())

    def _pending(self) -> list[int]:
        eng = self.worker.engine
        if not isinstance(eng, StepEngine):
            return []
        return sorted(j for j, p in eng.pending.items() if not p.copied)

    @precondition(lambda self: self._pending())
    @rule(i=st.integers(0, 7))
    def copy(self, i: int) -> None:
        """One submitted copy runs now (the i-th of those still to run, by job id)."""
        jobs = self._pending()
        if not jobs:  # a replayed schedule whose copy the protocol never submitted
            return
        self.copies_run += 1
        eng = self.worker.engine
        eng.on_copy = self._may_write
        eng.copy(jobs[i % len(jobs)])

    @precondition(lambda self: self._pending())
    @rule()
    def copy_last(self) -> None:
        """The newest submitted copy runs now (rule weighting: copies are what a schedule
        ends on, and a copy that waits is what every class needs)."""
        self.copy(len(self._pending()) - 1)

    @precondition(lambda self: self._copied())
    @rule()
    def completion(self) -> None:
        """The worker's completion thread: finished copies handled (stores committed, loads
        checked and queued for the next report) while no step runs."""
        w = self.worker
        with w._jobs_lock:
            w._handle(w.engine.poll())

    def _may_write(self, job: PendingCopy) -> bool:
        """ "loads" mode keeps a store's bytes out of slots its reservation no longer holds."""
        if self.mode != "loads" or job.direction is not Direction.STORE:
            return True
        info = self.worker._jobs.get(job.job_id)
        pool = self.pool
        if info is None or pool is None:
            return False
        ns = pool._namespaces.get(info[3])
        return ns is not None and info[2] in ns.index.stores

    # -- sessions, time, the sidecar ------------------------------------------------------
    def _client(self, who: str) -> InProcessClient:
        return self.sched_client if who == "scheduler" else self.worker_client

    @precondition(lambda self: self.sched_client.connected or self.worker_client.connected)
    @rule(who=st.sampled_from(["scheduler", "worker"]))
    def session_loss(self, who: str) -> None:
        """A call outlived its deadline: the client drops its session (the sidecar detaches
        the client; its pins go after the grace, its engine's reservations stay)."""
        self._client(who).lose_session()

    @precondition(lambda self: self.sched_client.connected)
    @rule()
    def lose_pins(self) -> None:
        """Macro step: the scheduler's session is lost, the keepers register again, and the
        grace passes (the reaper forgets the old client: its pins are gone)."""
        self.session_loss("scheduler")
        self.advance(GRACE_S + 0.5, keep=True)

    @precondition(
        lambda self: self.faults and self.sched_client.connected and self.scheduler._rpc.queue
    )
    @rule()
    def lookup_deadline(self) -> None:
        """The scheduler's next exchange is answered by the sidecar but too late."""
        self.sched_client.lose_next_answer()

    @precondition(
        lambda self: (
            self.faults and (not (self.sched_client.connected and self.worker_client.connected))
        )
    )
    @rule(who=st.sampled_from(["scheduler", "worker"]))
    def reconnect(self, who: str) -> None:
        """The client's keeper registers again (a new client id) when it is not connected."""
        self._client(who).ensure()

    @rule(dt=st.sampled_from([0.5, 2.5, 31.0]), keep=st.booleans())
    def advance(self, dt: float, keep: bool) -> None:
        """Time passes; the sidecar's reaper runs (detach grace 2 s; reservations of dead
        engines go, whatever the time). `keep`: the clients' keepers (every 0.2 s while
        away) registered again meanwhile."""
        self.clock.advance(dt)
        if keep:
            for c in (self.sched_client, self.worker_client, self.other.client):
                c.ensure()
        self.sidecar.reap()

    @rule(
        keys=st.lists(st.integers(0, NFILLERS + 2 * NPROMPTS - 1), min_size=1, max_size=4),
        land=st.booleans(),
    )
    def other_store(self, keys: list[int], land: bool = True) -> None:
        """The other engine stores keys (fillers, or prompt chunks it computed too); `land`:
        its copies land before its commit, else they wait for `other_copy`."""
        o = self.other
        try:
            if not o.ready():
                return
        except OSError:
            return
        universe = [filler_key(i) for i in range(NFILLERS)] + [
            k for p in range(NPROMPTS) for k in self._know_prompt(p, None)
        ]
        wanted = list(dict.fromkeys(universe[k] for k in keys))
        try:
            res = o.client.reserve_store(wanted)
            if not res.store_id:
                return
            slots = iter(res.slots)
            copies = [
                (next(slots), key) for key, d in zip(wanted, res.decisions, strict=True) if d == 1
            ]  # fmt: skip  (NEW)
            self.other_pending.append((res.store_id, copies))
            if land:
                self.other_copy()
        except PoolUnavailable:
            pass

    @rule()
    def pressure(self) -> None:
        """Macro step: the other engine stores as many filler keys it has not stored yet as
        the pool has slots (eviction of everything unpinned, its copies landing at once)."""
        ns = self.pool._namespaces.get(self.worker.namespace_id)
        committed = set(ns.index.committed_keys()) if ns is not None else set()
        fresh = [i for i in range(NFILLERS) if filler_key(i) not in committed]
        if fresh:
            self.other_store(fresh[:SLOTS])

    @precondition(lambda self: self.other_pending)
    @rule()
    def other_copy(self) -> None:
        """The other engine's oldest store: its copies land, then it commits."""
        store_id, copies = self.other_pending.pop(0)
        for slot, key in copies:
            self.view.tensor[slot] = torch.frombuffer(bytearray(self.truth[key]), dtype=torch.uint8)
        with contextlib.suppress(PoolUnavailable):
            self.other.commit(store_id)

    @precondition(lambda self: self.faults and self.other_deaths < MAX_OTHER_DEATHS)
    @rule(torn=st.booleans())
    def other_dies(self, torn: bool) -> None:
        """The other engine's process exits: its lock goes, its pending stores never commit
        (`torn`: the oldest one's copies had written half of its slots' bytes); a new one, with
        a new engine key, takes its place."""
        self.other_deaths += 1
        if torn and self.other_pending:
            for slot, key in self.other_pending[0][1]:
                half = SLOT_BYTES // 2
                self.view.tensor[slot, :half] = torch.frombuffer(
                    bytearray(self.truth[key][:half]), dtype=torch.uint8
                )
        self.other_pending.clear()
        self.other.die()
        self.other = OtherEngine(self.sidecar, OTHER_ENGINE + self.other_deaths, SPEC, SLOT_BYTES)

    @precondition(lambda self: self.faults and self.sidecar.boots <= MAX_RESTARTS)
    @rule(rejoin=st.booleans())
    def restart_sidecar(self, rejoin: bool = False) -> None:
        """The sidecar dies and its successor adopts the pool file (a new instance epoch);
        every session ends. `rejoin`: the clients' keepers registered again meanwhile."""
        self.sidecar.kill()
        self.sidecar.start()
        if rejoin:
            for c in (self.sched_client, self.worker_client, self.other.client):
                c.ensure()

    def _open_stores(self) -> list[tuple[str, int, int]]:
        return [
            (nid, sid, rec.owner)
            for nid, ns in self.pool._namespaces.items()
            for sid, rec in ns.index.stores.items()
        ]

    @precondition(
        lambda self: self.faults and len(self.sidecar.epochs) > 1 and self.stale_commits < 2
    )
    @rule(i=st.integers(0, 3), forge=st.booleans())
    def stale_commit(self, i: int, forge: bool) -> None:
        """A commit naming a previous sidecar instance arrives (a worker's commit queued
        before the restart; `forge`: it names a store this instance has open, as if the ids
        collided): refused, and nothing becomes visible."""
        self.stale_commits += 1
        c = self.worker_client
        if not c.ensure():
            return
        stores = self._open_stores()
        if forge and stores:
            nid, sid, owner = stores[i % len(stores)]
        else:
            nid, sid, owner = c.registration.namespace_id, (1 << 32) | 1, self.scheduler.engine
        old = self.sidecar.epochs[-2]
        try:
            visible = c.commit_store(nid, sid, 0, epoch=old, engine=owner)
        except PoolUnavailable:
            self.refused_commits += 1
            return
        raise AssertionError(f"a commit naming sidecar instance {old:#x} was accepted ({visible})")

    # -- search guidance ------------------------------------------------------------------
    @invariant()
    def guide_search(self) -> None:
        """Scores for hypothesis' targeted phase: how far a schedule got towards each class
        (a copy still to run whose slot's state word moved, or whose reservation is gone and
        whose slot went back to the free list or to another store)."""
        pool, w = self.pool, self.worker
        eng = w.engine
        if not isinstance(eng, StepEngine):
            return
        ns = pool._namespaces.get(w.namespace_id)
        if ns is None:
            return
        state = ns.table.state
        sched_jobs = self.scheduler._jobs
        for job_id, info in list(w._jobs.items()):
            p = eng.pending.get(job_id)
            if p is None or p.copied:
                continue
            if info[0] in ("load", "layered"):
                check = w._load_checks.get(job_id)
                job = sched_jobs.get(job_id)
                unpinned = job is not None and not set(job.pins) <= set(ns.index.pin_records)
                moved = check is not None and any(
                    int(state[s]) != v for s, v in zip(*check, strict=True)
                )
                self.best_load = max(self.best_load, 1 + unpinned + moved)
            elif info[0] == "store":
                # its reservation gone; then a slot of it neither withheld by an adopter nor
                # still its own; then that slot reserved or committed by another store
                gone = info[2] not in ns.index.stores
                withheld = set(ns.withheld.tolist())
                loose = [s for _, s, _ in p.blocks if s not in withheld] if gone else []
                taken = any(int(state[s]) != 0 for s in loose)
                self.best_store = max(self.best_store, 1 + gone + bool(loose) + taken)

    # -- invariants -----------------------------------------------------------------------
    @invariant()
    def pool_bookkeeping_holds(self) -> None:
        check_invariants(self.pool)

    @invariant()
    def committed_slots_hold_their_keys(self) -> None:
        """Class 2: no committed key's slot holds another key's bytes."""
        if self.mode == "loads":
            return
        for ns in self.pool._namespaces.values():
            for key in ns.index.committed_keys():
                slot = ns.index.find(key)
                got = self.view.tensor[slot].numpy().tobytes()
                assert got == self.truth[key], (
                    f"class 2: committed {self.names[key]} in slot {slot} holds {self._name(got)}"
                )


@contextlib.contextmanager
def step_engines() -> Iterator[None]:
    """Workers whose layout carries the model's GPU memory get a `StepEngine` (the real
    `_apply` maps the pool file and asks `make_engine` for an engine over it)."""
    real = pool_binding.make_engine

    def make(layout, pool, device, **kw):
        gpu = getattr(layout, "gpu", None)
        return (
            StepEngine(pool, gpu, BLOCK_BYTES)
            if gpu is not None
            else real(layout, pool, device, **kw)
        )

    pool_binding.make_engine = make
    try:
        yield
    finally:
        pool_binding.make_engine = real


def _tmpfs() -> str | None:
    import os

    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class BrokenVariant(SlotProtocol):
    """Negative controls: the protocol with one guarantee switched off (`variant`)."""

    @classmethod
    def variant(cls, broken: Broken, mode: str = "all") -> type[SlotProtocol]:
        return type(f"Broken_{broken.name}_{mode}", (cls,), {"broken": broken, "mode": mode})


class LoadsOnly(SlotProtocol):
    mode = "loads"


class SlotsOnly(SlotProtocol):
    mode = "slots"


__all__ = ["BrokenVariant", "LoadsOnly", "SlotProtocol", "SlotsOnly", "step_engines"]
