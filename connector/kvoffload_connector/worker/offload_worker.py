"""Worker side of the connector: one per GPU rank (vLLM worker process).

`register_kv_caches` canonicalises the KV cache (layout.py), registers this
rank with the sidecar, maps its region of the pool (PoolView) and builds a
transfer engine. Each step it submits the scheduler's load jobs
(`start_load_kv`) and store jobs (`wait_for_save`), polls completions,
commits finished stores to the sidecar (on a background thread), and reports
per-job outcomes back to the scheduler (`WorkerReport`).

Stores commit without a step: a completion thread per worker waits in the engine
(`wait_for_store`, no GIL held) and handles what finished exactly as the step's poll would,
under the job lock, so the last request before a quiet period, a shutdown or a crash reaches
the pool without another request; each job still goes into one report, once.

Nothing here waits on the sidecar during a step: until a registration and a
mapped, device-registered pool exist every job fails fast (a miss / a dropped
store). A job carries the pool generation its slots belong to; if the
sidecar recreated the pool, jobs for the other generation fail and the
worker re-maps after re-registering.

After a sidecar restart the new instance withholds the slots it found reserved for this
engine (a copy of ours may still land in them). Each rank tells it, over its own registration
(`Drained`), once it has no store copy in flight that names another sidecar instance; from
then on it refuses every store job naming an instance other than that one (or a later
registration's), so the word stays true and the instance frees those slots once every rank
said it (docs/POOL.md, the invariant).

Before a step's copies touch the pool the worker checks that the pool file
still covers its mapping (`PoolView.intact`): a file truncated under it would
turn the copies into SIGBUS and kill vLLM. When it does not, the step's loads
fail (vLLM recomputes), its stores are dropped, the view is unmapped, and the
worker serves without the pool until the sidecar rebuilds the file under a
new generation (it then ends every session: the worker re-registers and maps
again).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch

from kvoffload_connector.common import compat
from kvoffload_connector.common.client import PoolClient, PoolUnavailable, RegisterResult, RpcThread
from kvoffload_connector.common.config import ConnectorConfig
from kvoffload_connector.common.keys import build_spec
from kvoffload_connector.common.metadata import (
    ConnectorMeta,
    GroupTransfer,
    Registration,
    WorkerReport,
)
from kvoffload_connector.worker.engine_lock import EngineLock, lock_offset
from kvoffload_connector.worker.identity import model_identity
from kvoffload_connector.worker.layout import CanonicalLayout, canonicalize
from kvoffload_connector.worker.pool_view import PoolView
from kvoffload_connector.worker.slot_versions import SlotVersions
from kvoffload_connector.worker.transfer import Direction, JobResult, TransferBatch, make_engine

log = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])
# how long the completion thread waits in the engine per round, and shutdown for that thread
_COMPLETION_WAIT_S = 0.5
_COMPLETION_JOIN_S = 2.0


def _jobs_locked(fn: _F) -> _F:
    """Run a step-thread entry point under the job lock: the completion thread handles
    finished jobs under it too (job tables, reports, stats)."""

    @functools.wraps(fn)
    def locked(self: OffloadWorker, *args: Any, **kwargs: Any) -> Any:
        with self._jobs_lock:
            return fn(self, *args, **kwargs)

    return locked  # type: ignore[return-value]


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


class OffloadWorker:
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
        self._lock_key: tuple[str, int, int] | None = None  # (path, base, engine) it locks
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

    # -- registration ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.device = next(iter(kv_caches.values())).device
        self.layout = canonicalize(
            kv_caches,
            compat.layer_groups(self.kv_cache_config),
            self.chunk_blocks,
            self.kv_cache_config,
        )
        mc = self.vllm_config.model_config
        self.spec = build_spec(
            # the served name is the label stats show; the weights' identity is what matches
            model=str(getattr(mc, "served_model_name", None) or mc.model),
            identity=model_identity(self.vllm_config, compat.engine_id(self.vllm_config)),
            dtype=compat.kv_dtype(self.vllm_config),
            kv_layout=self.layout.tag,
            block_size=self.block_size,
            chunk_blocks=self.chunk_blocks,
            tp_size=self.tp_size,
            hash_algo=compat.hash_algo(self.vllm_config),
            group_specs=compat.group_descriptions(self.kv_cache_config),
            pp_size=self.pp_size,
        )
        log.info(
            "kvoffload: rank %d layout %s, slot %d bytes, %d groups",
            self.rank,
            self.layout.tag,
            self.layout.slot_bytes,
            len(self.layout.groups),
        )
        try:
            reg = self.client.register(self.spec, self.num_ranks, self.layout.slot_bytes)
            self._apply(reg)
        except PoolUnavailable as e:
            log.warning(
                "kvoffload: no pool from the sidecar at %s (%s); serving without it, retrying",
                self.cfg.socket,
                e,
            )
            self._report_no_pool = f"no pool from the sidecar: {e}"
        except (OSError, ValueError) as e:
            log.warning("kvoffload: cannot map the pool region: %s", e)
            self._report_no_pool = f"cannot map the pool region: {e}"

    def _apply(self, reg: RegisterResult) -> None:
        """Step thread: adopt a (re-)registration, re-mapping when the pool changed."""
        assert self.layout is not None and self.spec is not None
        region = reg.regions[self.rank]
        same = (
            self.pool is not None
            and reg.generation == self.generation
            and self.pool.path == region.path
            and self.pool.offset == region.offset
        )
        if not same:
            self._close_engine()
            # A re-map may run inside vLLM's inference_mode (a step); tensors made there are
            # inference tensors that the engine's copy thread could not write.
            with torch.inference_mode(False):
                self.pool = PoolView.open(
                    region.path, region.offset, region.slot_bytes, region.slot_count
                )
                self.pool.start_device_registration(self.device)
                self.engine = make_engine(
                    self.layout, self.pool, self.device, store_ctas=self.cfg.store_ctas
                )
            self._start_completion()
            self.generation = reg.generation
        if self.slot_versions is None and reg.slot_table_offset:
            self.slot_versions = SlotVersions(
                region.path, reg.slot_table_offset, reg.slot_record_bytes, region.slot_count
            )
        self.namespace_id = reg.namespace_id
        self._applied = reg
        self._report_drained()
        self._report_registration = Registration(
            self.spec, self.num_ranks, self.layout.slot_bytes, reg.namespace_id, reg.generation
        )

    @_jobs_locked
    def _close_engine(self) -> None:
        if self.engine is not None:
            try:
                self._handle(self.engine.wait(list(self._jobs)))
            finally:
                self.engine.shutdown()
                self.engine = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None
            self.generation = None
        # every copy into the old mapping finished (waited above): the lock may go
        self._release_engine_lock()
        if self.slot_versions is not None:
            self.slot_versions.close()
            self.slot_versions = None

    def _hold_engine_lock(self, engine: int) -> bool:
        """Step thread, before a step's copies: hold this rank's lock for `engine` in the
        mapped generation's range (the sidecar grants the engine's reservations only while
        every rank holds one, and reuses their slots only once none does). False: no lock
        (the step's stores fail)."""
        reg, pool = self._applied, self.pool
        if not engine or reg is None or pool is None or not reg.engine_lock_base:
            return False
        key = (pool.path, reg.engine_lock_base, engine)
        if self._lock_key == key and self._engine_lock is not None:
            return True
        if self._lock_key is not None and self._lock_key[:2] != key[:2] and self._jobs:
            return False  # a lock of another mapping with copies in flight: keep that one
        try:
            lock = EngineLock(pool.path, lock_offset(key[1], engine, self.rank))
        except (OSError, ValueError) as e:
            log.warning("kvoffload: rank %d cannot hold its engine lock: %s", self.rank, e)
            return False
        self._release_engine_lock()  # same mapping, another engine key: nothing in flight
        self._engine_lock, self._lock_key = lock, key
        return True

    def _release_engine_lock(self) -> None:
        if self._engine_lock is not None:
            self._engine_lock.release()
        self._engine_lock, self._lock_key = None, None

    def _reconnect(self) -> None:
        """Rpc thread: re-register when due; the step thread applies the result."""
        try:
            stale = self.client.registration is None or not self.client.connected
            if stale and self.client.ensure():
                with self._lock:
                    self._new_registration = self.client.registration
        finally:
            self._reconnect_queued = False

    def _maybe_reconnect(self) -> None:
        with self._lock:
            reg, self._new_registration = self._new_registration, None
        current = self.client.registration  # the client's keeper may have re-registered
        if reg is None and current is not None and current is not self._applied:
            reg = current
        if reg is not None:
            try:
                self._apply(reg)
            except (OSError, ValueError) as e:
                self._applied = reg  # said once; the next registration tries again
                log.warning("kvoffload: cannot map the pool region: %s", e)
        if self.spec is not None and not self.client.connected and not self._reconnect_queued:
            self._reconnect_queued = True
            self._rpc.submit(self._reconnect)

    def _check_pool(self) -> None:
        """Step thread, before a step's copies: drop the view when the pool file no longer
        covers it (touching it would SIGBUS); the step's jobs then fail as not ready."""
        pool = self.pool
        if pool is None or pool.intact():
            return
        log.warning(
            "kvoffload: the pool file %s shrank under the mapping (%d < %d bytes); "
            "serving without the pool until the sidecar rebuilds it",
            pool.path,
            pool.file_size(),
            pool.needed_bytes,
        )
        self._stats["pool_file_lost"] = self._stats.get("pool_file_lost", 0) + 1
        self._close_engine()  # waits for copies in flight (the CPU engine fails them unrun)

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.pool is not None and self.pool.ready

    # -- jobs -----------------------------------------------------------------------------
    @_jobs_locked  # also what keeps the completion thread's poll from starting layered loads
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
        if meta.engine and self.ready:
            self._hold_engine_lock(meta.engine)  # as early as possible: stores wait for it
        if meta.loads:
            self._check_pool()
        for job in meta.loads:
            blocks = [b for t in job.transfers for b in t.gpu_blocks]
            check = self._load_check(job)
            if not self.ready or job.generation != self.generation or check is None:
                log.info(
                    "kvoffload: rank %d fails load job %d (ready %s, generation %s/%s)",
                    self.rank,
                    job.job_id,
                    self.ready,
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

    @_jobs_locked
    def wait_for_save(self, meta: ConnectorMeta | None) -> None:
        """Submit the step's store jobs, once per metadata object (callers may repeat it)."""
        if meta is None or meta is self._saved_meta:
            return
        self._saved_meta = meta  # a reference, not an id(): a freed object's id can come back
        if meta.stores:
            self._check_pool()
        locked = bool(meta.stores) and self.ready and self._hold_engine_lock(meta.engine)
        for job in meta.stores:
            if (
                not self.ready
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

    def _may_store(self, epoch: int) -> bool:
        """Job lock held: a store job naming sidecar instance `epoch` may start its copies:
        always until this rank reported drained; afterwards only for the instance it reported
        to, or the one it is registered with now (the earlier one is gone)."""
        drained, reg = self._drained_epoch, self._applied
        return not drained or epoch == drained or (reg is not None and epoch == reg.epoch)

    @_jobs_locked
    def _report_drained(self) -> None:
        """Tell the registration's sidecar instance, once, that this rank has no store copy in
        flight naming another instance (every such job finished, failed or was never started)
        and will start none: it then frees the slots it withheld for this engine. Called
        whenever a job finishes, a registration is applied or the engine key is learnt."""
        reg, engine = self._applied, self._engine_key
        if reg is None or not reg.epoch or not engine or self._drained_epoch == reg.epoch:
            return
        epoch = reg.epoch
        if any(self._store_fences[j][0] != epoch for j in self._jobs if j in self._store_fences):
            return  # a copy into another instance's reservation may still land
        self._drained_epoch = epoch  # before the word leaves: no such copy starts from here
        ns, rank = reg.namespace_id, self.rank
        self._rpc.submit(lambda: self._send_drained(ns, epoch, engine, rank))

    def _send_drained(self, namespace_id: str, epoch: int, engine: int, rank: int) -> None:
        try:
            freed = self.client.report_drained(namespace_id, epoch=epoch, engine=engine, rank=rank)
        except PoolUnavailable as e:  # another instance by now: its own report follows
            log.debug("kvoffload: rank %d drained report dropped: %s", rank, e)
            return
        if freed:
            log.info("kvoffload: rank %d drained: the sidecar freed %d withheld slots", rank, freed)

    # -- completion without a step ------------------------------------------------------
    def _start_completion(self) -> None:
        """The completion thread, once, for an engine that can wait for its stores."""
        if self._completion is None and hasattr(self.engine, "wait_for_store"):
            self._completion = threading.Thread(
                target=self._complete_loop, name=f"kvoffload-rank{self.rank}-done", daemon=True
            )
            self._completion.start()

    def _stores_in_flight(self) -> bool:
        return self.engine is not None and any(k[0] == "store" for k in self._jobs.values())

    def _complete_loop(self) -> None:
        """Commit stores whose copies finished while no step polls the engine (vLLM steps
        only while requests run): wait in the engine without the job lock or the GIL, then
        handle what finished under the lock, as `transfer_results` would. `_handle` pops each
        job from `_jobs` under the lock, so it commits once and enters one report once,
        whichever thread saw it first. Loads that finished are handled alike (reported at the
        next step). The step thread holds the lock from `submit_layered` to `start_layered`,
        so the engine's poll here never finds layered loads to start."""
        while True:
            with self._jobs_lock:
                while not self._closing and not self._stores_in_flight():
                    self._jobs_changed.wait()
                if self._closing:
                    return
                engine = self.engine
            try:
                engine.wait_for_store(_COMPLETION_WAIT_S)
                with self._jobs_lock:
                    if self.engine is engine and not self._closing:
                        results = engine.poll()
                        self._handle(results)
                        if not results:  # never a spin, whatever the engine answers
                            self._jobs_changed.wait(_COMPLETION_WAIT_S / 10)
            except Exception:  # noqa: BLE001 - the step's poll still reports every job
                log.warning("kvoffload: store completion thread stopped", exc_info=True)
                return

    def _stop_completion(self) -> None:
        with self._jobs_lock:
            self._closing = True
            self._jobs_changed.notify_all()
        if self._completion is not None:
            self._completion.join(_COMPLETION_JOIN_S)

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

    def _commit(self, namespace_id: str, store_id: int, epoch: int = 0, engine: int = 0) -> None:
        try:
            self.client.commit_store(namespace_id, store_id, self.rank, epoch=epoch, engine=engine)
        except PoolUnavailable as e:
            log.debug("kvoffload: commit of store %d dropped: %s", store_id, e)

    def _add(self, **values: float) -> None:
        for k, v in values.items():
            self._stats[k] = self._stats.get(k, 0) + v

    @_jobs_locked
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

    @_jobs_locked
    def take_failed_layered_blocks(self) -> set[int]:
        """Blocks of this step's layered loads that did not load (vLLM recomputes them)."""
        blocks, self._failed_layered_blocks = self._failed_layered_blocks, set()
        return blocks

    @_jobs_locked
    def report(self) -> WorkerReport | None:
        reg, self._report_registration = self._report_registration, None
        no_pool, self._report_no_pool = self._report_no_pool, ""
        ready = self.ready
        changed = ready != self._reported_ready
        self._reported_ready = ready
        if not self._done and not self._failed and reg is None and not changed and not no_pool:
            return None
        out = WorkerReport(
            done=self._done,
            failed=self._failed,
            registration=reg,
            ready={self.rank: ready} if changed or reg is not None else {},
            no_pool=no_pool,
        )
        self._done, self._failed = {}, {}
        return out

    def stats_pending(self) -> bool:
        return bool(self._stats)

    @_jobs_locked
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
