"""A worker rank's binding to the pool: registration, the mapping, the engine lock.

`register_kv_caches` canonicalises the KV cache (layout.py), registers this rank with the
sidecar, maps its region of the pool (PoolView) and builds a transfer engine over it. Nothing
here waits on the sidecar during a step: until a registration and a mapped, device-registered
pool exist every job fails fast (a miss / a dropped store). A job carries the pool generation
its slots belong to; if the sidecar recreated the pool, jobs for the other generation fail and
the rank re-maps after re-registering (on the RPC thread; the step thread applies the result).

Before a step's copies touch the pool the rank checks that the pool file still covers its
mapping (`PoolView.intact`): a file truncated under it would turn the copies into SIGBUS and
kill vLLM. When it does not, the step's loads fail (vLLM recomputes), its stores are dropped,
the view is unmapped, and the rank serves without the pool until the sidecar rebuilds the file
under a new generation (it then ends every session: the rank re-registers and maps again).

The engine lock (engine_lock.py) is held for the mapped generation from before a step's first
store copy until every copy into that mapping finished.

In node placement the registration names a tenant's memfd instead of a path (pool_memory.py):
the rank maps, reads the slot table and locks through its own description of it, taken when it
registered, and keeps the mapping across registrations only for the same memfd and generation.
"""

from __future__ import annotations

import logging

import torch

from kvoffload_connector.common import compat
from kvoffload_connector.common.client import PoolUnavailable, RegisterResult
from kvoffload_connector.common.keys import build_spec
from kvoffload_connector.common.metadata import Registration
from kvoffload_connector.worker.engine_lock import EngineLock, lock_offset
from kvoffload_connector.worker.identity import model_identity
from kvoffload_connector.worker.job_lock import jobs_locked
from kvoffload_connector.worker.layout import canonicalize
from kvoffload_connector.worker.pool_pieces import (
    WHOLE_POOL_PREFAULTED,
    PrefaultState,
    PrefaultWatch,
    ServerPrefault,
)
from kvoffload_connector.worker.pool_view import PoolView
from kvoffload_connector.worker.slot_versions import SlotVersions
from kvoffload_connector.worker.transfer import make_engine

log = logging.getLogger(__name__)


class PoolBinding:
    """Mixed into `OffloadWorker` (offload_worker.py), which owns the state: the client, the
    layout, the mapped `pool`, the `engine`, the applied registration and the job tables."""

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
                "kvoffload: no pool from %s at %s (%s); serving without it, retrying",
                self._tenant.server,
                self.cfg.socket,
                e,
            )
            self._report_no_pool = f"no pool from {self._tenant.server}: {e}"
        except (OSError, ValueError) as e:
            log.warning("kvoffload: cannot map the pool region: %s", e)
            self._report_no_pool = self._map_problem = f"cannot map the pool region: {e}"

    def _apply(self, reg: RegisterResult) -> None:
        """Step thread: adopt a (re-)registration, re-mapping when the pool changed."""
        assert self.layout is not None and self.spec is not None
        region = reg.regions[self.rank]
        # node placement: this registration's own description of the tenant's memfd (taken
        # when it registered, pool_memory.py); None for a pool file
        memory = self._tenant.take(reg)
        held = self._memory
        same = (
            self.pool is not None
            and reg.generation == self.generation
            and self.pool.offset == region.offset
            and (
                self.pool.path == region.path and held is None
                if memory is None
                else held is not None and memory.key == held.key
            )
        )
        if same and memory is not None:
            memory.close()  # the same memfd, mapped and locked through the description held
        if not same:
            self._close_engine()
            # A re-map may run inside vLLM's inference_mode (a step); tensors made there are
            # inference tensors that the engine's copy thread could not write.
            with torch.inference_mode(False):
                if memory is not None:
                    try:
                        self.pool = memory.view(region)
                    except BaseException:
                        memory.close()
                        raise
                    self._memory = memory
                else:
                    self.pool = PoolView.open(
                        region.path, region.offset, region.slot_bytes, region.slot_count
                    )
                registrar = self.registrar(self.device) if self.registrar is not None else None
                self.pool.start_device_registration(
                    self.device, registrar, self._prefault_watch(reg)
                )
                self.engine = make_engine(
                    self.layout, self.pool, self.device, store_ctas=self.cfg.store_ctas
                )
            self._start_completion()
            self.generation = reg.generation
        if self.slot_versions is None and reg.slot_table_offset:
            if self._memory is not None:
                self.slot_versions = self._memory.slot_versions(reg, region)
            else:
                self.slot_versions = SlotVersions(
                    region.path, reg.slot_table_offset, reg.slot_record_bytes, region.slot_count
                )
        self.namespace_id = reg.namespace_id
        self._applied = reg
        self._map_problem = ""
        self._report_drained()
        self._report_registration = Registration(
            self.spec, self.num_ranks, self.layout.slot_bytes, reg.namespace_id, reg.generation
        )

    def _prefault_watch(self, reg: RegisterResult) -> PrefaultWatch:
        """How the registration thread learns that the owner's pre-fault passed a piece: done
        when the answer said the pool is ready, else the namespace's pre-faulted slots from
        the pool's Stats (asked only while a piece waits, at a bounded rate)."""
        if reg.pool_ready:
            return WHOLE_POOL_PREFAULTED
        client, namespace_id = self.client, reg.namespace_id

        def ask() -> PrefaultState:
            resp = client.stats()
            slots = next(
                (n.prefaulted_slots for n in resp.namespaces if n.namespace_id == namespace_id),
                0,
            )
            return PrefaultState(resp.pool_ready, slots)

        return ServerPrefault(PrefaultState(False), ask)

    @jobs_locked
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
        if self._memory is not None:  # nothing maps or locks through it any more
            self._memory.close()
            self._memory = None

    def _hold_engine_lock(self, engine: int) -> bool:
        """Step thread, before a step's copies: hold this rank's lock for `engine` in the
        mapped generation's range (the sidecar grants the engine's reservations only while
        every rank holds one, and reuses their slots only once none does). False: no lock
        (the step's stores fail)."""
        reg, pool = self._applied, self.pool
        if not engine or reg is None or pool is None or not reg.engine_lock_base:
            return False
        memory = self._memory  # node placement: the lock sits on this rank's description
        key = (pool.path if memory is None else memory.key, reg.engine_lock_base, engine)
        if self._lock_key == key and self._engine_lock is not None:
            return True
        if self._lock_key is not None and self._lock_key[:2] != key[:2] and self._jobs:
            return False  # a lock of another mapping with copies in flight: keep that one
        try:
            offset = lock_offset(key[1], engine, self.rank)
            lock = EngineLock(pool.path, offset) if memory is None else memory.engine_lock(offset)
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
                self._map_problem = f"cannot map the pool region: {e}"
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
        """Every slot of the rank's region may be copied (mapped and registered)."""
        return self.engine is not None and self.pool is not None and self.pool.ready

    @property
    def usable_end(self) -> int:
        """Slots [0, usable_end) may be copied now (the pieces registered so far)."""
        pool = self.pool
        return pool.usable_end if self.engine is not None and pool is not None else 0

    def _usable_for(self, transfers) -> bool:
        """Every slot of a job's transfers lies in the registered part of the mapping."""
        end = self.usable_end
        return end > 0 and all(not t.slots or max(t.slots) < end for t in transfers)

    def no_pool_reason(self) -> str:
        """Why this rank serves without the pool now ("" while it is mapped, device-registered
        and attached), for the status file."""
        pool, client, server = self.pool, self.client, self._tenant.server
        if not client.connected:
            why = client.last_error or self._tenant.problem or "not registered yet"
            return f"no pool from {server} at {self.cfg.socket} (retrying): {why}"
        if self.ready:
            return ""
        if pool is None:
            return self._map_problem or "the pool region is not mapped yet"
        if pool.error:
            return f"device registration failed: {pool.error}"
        total = pool.slot_count * pool.slot_bytes
        tenth = pool.registered_bytes * 10 // total  # in tenths: the status changes 10 times
        if not tenth:
            return "registering the pool with the device"
        return (
            f"registering the pool with the device: {tenth * 10}% of {total / 1e9:.1f} GB so "
            "far, loads and stores use that part"
        )
