"""Worker side of the connector: one per GPU rank (vLLM worker process).

Each step it submits the scheduler's load jobs (`start_load_kv`) and store jobs
(`wait_for_save`), polls completions, and reports per-job outcomes back to the scheduler
(`WorkerReport`). A load's bytes count only if its slots still hold the versions it was pinned
at after the copy (slot_versions.py). Its parts: the binding to the pool (pool_binding.py:
registration, mapping, engine lock, the pool file check) and the end of stores
(store_completion.py: commits without a step, the drained word after a sidecar restart).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvoffload_connector.common import compat
from kvoffload_connector.common.client import PoolClient, RegisterResult, RpcThread
from kvoffload_connector.common.config import ConnectorConfig
from kvoffload_connector.common.metadata import (
    ConnectorMeta,
    GroupTransfer,
    Registration,
    WorkerReport,
)
from kvoffload_connector.worker.engine_lock import EngineLock
from kvoffload_connector.worker.job_lock import jobs_locked
from kvoffload_connector.worker.layout import CanonicalLayout
from kvoffload_connector.worker.pool_binding import PoolBinding
from kvoffload_connector.worker.pool_memory import TenantAttach, TenantMemory
from kvoffload_connector.worker.pool_pieces import Registrar
from kvoffload_connector.worker.pool_view import PoolView
from kvoffload_connector.worker.slot_versions import SlotVersions
from kvoffload_connector.worker.store_completion import StoreCompletion
from kvoffload_connector.worker.transfer import Direction, JobResult, TransferBatch

log = logging.getLogger(__name__)


def _batches(transfers: tuple[GroupTransfer, ...]) -> list[TransferBatch]:
    return [
        TransferBatch(
            t.group,
            np.asarray(t.gpu_blocks, dtype=np.int64),
            np.asarray(t.slots, dtype=np.int64),
            np.asarray(t.slot_block_index, dtype=np.int64),
        )
        for t in transfers
    ]


class OffloadWorker(PoolBinding, StoreCompletion):
    def __init__(
        self,
        cfg: ConnectorConfig,
        *,
        vllm_config: Any,
        kv_cache_config: Any,
        rank: int,
        engine_name: str = "engine",
    ):
        self.cfg = cfg
        self.rank = rank
        self.tp_size, self.pp_size, self.num_ranks = compat.world(vllm_config)
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.block_size = compat.block_size(vllm_config, kv_cache_config)
        self.chunk_blocks = cfg.chunk_tokens // self.block_size
        self.client = PoolClient.from_config(cfg, f"{cfg.client_name}/{engine_name}/rank-{rank}")
        # node placement: the tenant memory each registration names, taken on the thread that
        # registers (pool_memory.py), and this rank's own description of it once mapped
        self._tenant = TenantAttach(cfg, rank)
        self.client.accept = self._tenant.accept
        self._memory: TenantMemory | None = None
        self._map_problem = ""  # why the last registration's region could not be mapped
        self._rpc = RpcThread(f"kvoffload-rank{rank}-rpc")
        self.layout: CanonicalLayout | None = None
        self.device: torch.device | None = None
        self.pool: PoolView | None = None
        self.engine: Any = None
        self.generation: str | None = None
        self.namespace_id = ""
        self._new_registration: RegisterResult | None = None  # set by the rpc thread
        self._applied: RegisterResult | None = None  # the registration the step thread uses
        self._lock = threading.Lock()
        self._reconnect_queued = False
        self._report_registration: Registration | None = None
        self._report_no_pool = ""  # why the first registration found no pool (sent once)
        self._reported_ready: bool | None = None
        self._reported_usable: int | None = None
        # replaces cudaHostRegister for the mapping's pieces (tests drive it piece by piece)
        self.registrar: Callable[[torch.device], Registrar] | None = None
        self._jobs: dict[int, tuple[str, str, int, str]] = {}  # id -> (kind, req, store id, ns)
        self._saved_meta: ConnectorMeta | None = None  # the metadata whose stores went out
        self._load_blocks: dict[int, list[int]] = {}
        self._done: dict[int, int] = {}
        self._failed: dict[int, int] = {}
        self._recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._failed_layered_blocks: set[int] = set()
        self._layered_step = False  # a layered load was submitted for this step's forward
        # A forward replayed as one full CUDA graph skips wait_for_layer_load: there the compute
        # stream waits for the whole layered load once, before the forward (still no host wait).
        self._full_graphs = compat.full_graph_batches(vllm_config)
        self._uniform_query = compat.uniform_query_tokens(vllm_config)
        self._wait_whole_step = False
        self._stats: dict[str, float] = {}
        self.spec = None
        # Slot protocol: the versions a load checks after its copy (slot_versions.py), the
        # engine lock this rank holds while it may write the pool (engine_lock.py), and per
        # job what its check and its commit need.
        self.slot_versions: SlotVersions | None = None
        self._engine_lock: EngineLock | None = None
        # (pool file path or tenant memory key, base, engine) it locks
        self._lock_key: tuple[object, int, int] | None = None
        self._load_checks: dict[int, tuple[list[int], list[int]]] = {}  # job: slots, versions
        self._store_fences: dict[int, tuple[int, int]] = {}  # job: sidecar epoch, engine
        self._engine_key = 0  # the engine this rank stores for (the scheduler's, per step)
        # the sidecar instance told this rank drained of every other one's reservations
        # (`_report_drained`): store jobs naming another instance are refused from then on
        self._drained_epoch = 0
        # job tables, reports and stats: the step thread and the completion thread
        self._jobs_lock = threading.RLock()
        self._jobs_changed = threading.Condition(self._jobs_lock)
        self._completion: threading.Thread | None = None
        self._closing = False

    # -- jobs -----------------------------------------------------------------------------
    @jobs_locked  # also what keeps the completion thread's poll from starting layered loads
    def start_load_kv(self, meta: ConnectorMeta | None) -> None:
        self._maybe_reconnect()
        if self._layered_step:
            self._layered_step = False
            if self.engine is not None:
                self.engine.new_step()
        if meta is None:
            return
        if meta.fence:
            self._finish_fenced(meta.fence)
        if meta.engine and meta.engine != self._engine_key:
            self._engine_key = meta.engine
            self._report_drained()
        if meta.engine and self.usable_end:
            self._hold_engine_lock(meta.engine)  # as early as possible: stores wait for it
        if meta.loads:
            self._check_pool()
        for job in meta.loads:
            blocks = [b for t in job.transfers for b in t.gpu_blocks]
            check = self._load_check(job)
            usable = self._usable_for(job.transfers)  # no slot past the registered pieces
            if not usable or job.generation != self.generation or check is None:
                log.info(
                    "kvoffload: rank %d fails load job %d (registered %s, generation %s/%s)",
                    self.rank,
                    job.job_id,
                    usable,
                    job.generation,
                    self.generation,
                )
                self._fail_load(job.job_id, job.req_id, blocks, job.layered)
                continue
            self._jobs[job.job_id] = ("layered" if job.layered else "load", job.req_id, 0, "")
            self._load_blocks[job.job_id] = blocks
            self._load_checks[job.job_id] = check
            try:
                if job.layered:
                    self.engine.submit_layered(job.job_id, _batches(job.transfers))
                    self._layered_step = True
                else:
                    self.engine.submit(job.job_id, Direction.LOAD, _batches(job.transfers))
            except Exception as e:  # noqa: BLE001 - a bad job is a failed load, never a crash
                log.warning("kvoffload: load job %d rejected: %s", job.job_id, e)
                self._jobs.pop(job.job_id, None)
                self._fail_load(job.job_id, job.req_id, blocks, job.layered)
        if self._layered_step:
            self.engine.start_layered()  # every layered load of the step, layer by layer
        self._wait_whole_step = self._layered_step and self._may_replay_full_graph(meta)
        if self._wait_whole_step:
            self.engine.wait_all_layers()

    def _finish_fenced(self, job_ids: tuple[int, ...]) -> None:
        """vLLM got these jobs' blocks back before they finished (a prefix-cache reset): the
        copies complete before this step's forward, or our loads, can write into them. Rare
        (a reset with copies in flight), so a host wait serves every engine alike."""
        ids = [j for j in job_ids if j in self._jobs]
        if ids and self.engine is not None:
            self._handle(self.engine.wait(ids))

    def _may_replay_full_graph(self, meta: ConnectorMeta) -> bool:
        """Whether this step's forward may run as one full CUDA graph (no per-layer hooks). A
        request computing more tokens than a uniform decode makes the batch mixed, and mixed
        batches run piecewise or eager where only uniform batches get full graphs."""
        if self._full_graphs == "none":
            return False
        if self._full_graphs == "uniform":
            return not meta.longest_query > self._uniform_query
        return True

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Called per layer in every forward: one flag test unless this step loads layered."""
        if self._layered_step and not self._wait_whole_step and self.engine is not None:
            self.engine.wait_layer(layer_name)

    def _fail_load(self, job_id: int, req_id: str, blocks: list[int], layered: bool) -> None:
        """An async load fails its request (vLLM recomputes it); a layered one, whose request
        runs this step, fails its blocks (vLLM recomputes from the first bad block)."""
        self._failed[job_id] = self._failed.get(job_id, 0) + 1
        if layered:
            self._failed_layered_blocks.update(blocks)
        else:
            self._recving.add(req_id)
            self._failed_recving.add(req_id)
            self._failed_blocks.update(blocks)
        self._stats["failed_loads"] = self._stats.get("failed_loads", 0) + 1
        self._load_blocks.pop(job_id, None)

    @jobs_locked
    def wait_for_save(self, meta: ConnectorMeta | None) -> None:
        """Submit the step's store jobs, once per metadata object (callers may repeat it)."""
        if meta is None or meta is self._saved_meta:
            return
        self._saved_meta = meta  # a reference, not an id(): a freed object's id can come back
        if meta.stores:
            self._check_pool()
        locked = bool(meta.stores) and self.usable_end and self._hold_engine_lock(meta.engine)
        for job in meta.stores:
            if (
                not self._usable_for(job.transfers)  # never into unregistered memory: aborted
                or job.generation != self.generation
                or not locked
                or not self._may_store(job.epoch)
            ):
                self._failed[job.job_id] = self._failed.get(job.job_id, 0) + 1
                self._stats["failed_stores"] = self._stats.get("failed_stores", 0) + 1
                continue
            self._jobs[job.job_id] = ("store", "", job.store_id, job.namespace_id)
            self._store_fences[job.job_id] = (job.epoch, job.engine)
            try:
                self.engine.submit(job.job_id, Direction.STORE, _batches(job.transfers))
            except Exception as e:  # noqa: BLE001
                log.warning("kvoffload: store job %d rejected: %s", job.job_id, e)
                self._jobs.pop(job.job_id, None)
                self._store_fences.pop(job.job_id, None)
                self._failed[job.job_id] = self._failed.get(job.job_id, 0) + 1
        if meta.stores:
            self._jobs_changed.notify_all()  # the completion thread waits for these

    def _handle(self, results: list[JobResult]) -> None:
        for r in results:
            info = self._jobs.pop(r.job_id, None)
            if info is None:
                continue
            kind, req_id, store_id, ns = info
            if kind in ("load", "layered"):
                if r.ok and not self._versions_held(r.job_id):
                    # a store took a slot of this load while it copied: its bytes may be
                    # another key's; vLLM recomputes
                    r = JobResult(r.job_id, False, 0, r.seconds, "a slot changed under the copy")
                self._load_checks.pop(r.job_id, None)
                if r.ok:
                    self._done[r.job_id] = self._done.get(r.job_id, 0) + 1
                    if kind == "load":  # a layered load's request is already running
                        self._recving.add(req_id)
                    self._load_blocks.pop(r.job_id, None)
                    self._add(loaded_bytes=r.bytes, load_seconds=r.seconds)
                else:
                    log.warning("kvoffload: load job %d failed: %s", r.job_id, r.error)
                    blocks = self._load_blocks.get(r.job_id, [])
                    self._fail_load(r.job_id, req_id, blocks, kind == "layered")
            elif r.ok:
                self._done[r.job_id] = self._done.get(r.job_id, 0) + 1
                self._add(stored_bytes=r.bytes, store_seconds=r.seconds)
                epoch, engine = self._store_fences.pop(r.job_id, (0, 0))
                self._rpc.submit(lambda s=store_id, n=ns, f=(epoch, engine): self._commit(n, s, *f))
            else:
                self._store_fences.pop(r.job_id, None)
                log.warning("kvoffload: store job %d failed: %s", r.job_id, r.error)
                self._failed[r.job_id] = self._failed.get(r.job_id, 0) + 1
                self._stats["failed_stores"] = self._stats.get("failed_stores", 0) + 1
        if results and self._drained_epoch != getattr(self._applied, "epoch", 0):
            self._report_drained()

    def _load_check(self, job: Any) -> tuple[list[int], list[int]] | None:
        """(slots, versions) a load's copy must find unchanged afterwards; None when the job
        carries no version for some slot or this rank cannot read the slot table (the load
        fails: a slot nobody can vouch for is never loaded)."""
        versions = getattr(job, "versions", ())
        if self.slot_versions is None or len(versions) != len(job.transfers):
            return None
        slots: list[int] = []
        want: list[int] = []
        for t, v in zip(job.transfers, versions, strict=True):
            if len(v) != len(t.slots):
                return None
            slots += t.slots
            want += v
        return slots, want

    def _versions_held(self, job_id: int) -> bool:
        """After a load's copy completed: its slots still hold the versions it was pinned at
        (every writer changes a slot's state word before it writes a byte)."""
        check = self._load_checks.get(job_id)
        sv = self.slot_versions
        return check is not None and sv is not None and sv.matches(*check)

    def _add(self, **values: float) -> None:
        for k, v in values.items():
            self._stats[k] = self._stats.get(k, 0) + v

    @jobs_locked
    def transfer_results(self) -> tuple[set[str], set[str], set[int]]:
        """(finished_recving, failed_recving, failed async load block ids) since the last
        call; failed layered blocks wait in ``take_failed_layered_blocks``. This step's
        layered loads are waited for first: their versions are checked after the copy, and
        a failure must reach vLLM in this step's output, which then drops the step's token
        for the request and recomputes the blocks."""
        if self.engine is not None and self._jobs:
            layered = [j for j, info in self._jobs.items() if info[0] == "layered"]
            if layered:
                self._handle(self.engine.wait(layered))
            self._handle(self.engine.poll())
        recving, failed = self._recving, self._failed_recving
        blocks = self._failed_blocks
        self._recving, self._failed_recving, self._failed_blocks = set(), set(), set()
        return recving, failed, blocks

    @jobs_locked
    def take_failed_layered_blocks(self) -> set[int]:
        """Blocks of this step's layered loads that did not load (vLLM recomputes them)."""
        blocks, self._failed_layered_blocks = self._failed_layered_blocks, set()
        return blocks

    @jobs_locked
    def report(self) -> WorkerReport | None:
        reg, self._report_registration = self._report_registration, None
        no_pool, self._report_no_pool = self._report_no_pool, ""
        ready, usable = self.ready, self.usable_end
        changed = ready != self._reported_ready or usable != self._reported_usable
        self._reported_ready, self._reported_usable = ready, usable
        if not self._done and not self._failed and reg is None and not changed and not no_pool:
            return None
        tell = changed or reg is not None
        out = WorkerReport(
            done=self._done,
            failed=self._failed,
            registration=reg,
            ready={self.rank: ready} if tell else {},
            usable={self.rank: usable} if tell else {},
            no_pool=no_pool,
        )
        self._done, self._failed = {}, {}
        return out

    def stats_pending(self) -> bool:
        return bool(self._stats)

    @jobs_locked
    def take_stats(self) -> dict[str, float]:
        s, self._stats = self._stats, {}
        return s

    def shutdown(self) -> None:
        """Stores whose copies are in flight finish and commit (copies end; the commits run
        on the RPC thread, which `close` gives a bounded time), then the engine goes."""
        try:
            self._stop_completion()
            self._close_engine()
        finally:
            self._rpc.close()
            self.client.close()
            self._tenant.close()
