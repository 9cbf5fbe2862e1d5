"""The connector with the pool: config, checks, then the scheduler or the worker half.

Built by the facade (`connector.py`) inside a guard: anything raised here, an import of grpc,
protobuf or our stubs included, leaves vLLM serving without the pool instead of crashing it.
`precheck` is the part that needs no KV cache config, so the API server's metrics can say the
same reason the engine logs.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvoffload_connector import guard
from kvoffload_connector.common import compat
from kvoffload_connector.common.compat import KVConnectorTransferResults
from kvoffload_connector.common.config import ConnectorConfig, parse_extra_config
from kvoffload_connector.common.metadata import ConnectorMeta, PoolHandshake, Registration

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class Unsupported(Exception):
    """A setting or model the pool cannot serve; the message is the reason users see."""


def import_deps() -> None:
    """Import what a stock vLLM image may lack or ship too old (grpcio, protobuf, our stubs),
    after appending the payload's own deps folder to the end of sys.path."""
    guard.check_test_import_failures()
    guard.add_payload_deps()
    import google.protobuf  # noqa: F401
    import grpc  # noqa: F401
    from kvoffload.v1 import pool_pb2, pool_pb2_grpc  # noqa: F401


def precheck(vllm_config: Any, kv_cache_config: Any = None) -> ConnectorConfig:
    """Every reason to serve without the pool that is known before the halves are built;
    raises (Unsupported, ValueError, ImportError...) with it."""
    problem = compat.version_problem(compat.vllm_version())
    if problem:
        raise Unsupported(problem)
    problem = compat.model_problem(vllm_config, kv_cache_config)
    if problem:
        raise Unsupported(problem)
    sizes = set(compat.group_block_sizes(kv_cache_config))
    if len(sizes) > 1:
        raise Unsupported(f"KV cache groups have different block sizes {sorted(sizes)}")
    block_size = compat.block_size(vllm_config, kv_cache_config)
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    cfg = parse_extra_config(extra, block_size)
    import_deps()
    return cfg


def restart_note(vllm_config: Any) -> str:
    """Why a restarted engine will not find what this one stored ("" when it will)."""
    algo = compat.hash_algo(vllm_config)
    if compat.hashes_survive_restart(algo):
        return ""
    return (
        f"PYTHONHASHSEED is unset and this vLLM seeds its {algo} block hashes per process: "
        "pool hits last this engine's life, a restarted engine will not find what it stored "
        "(set PYTHONHASHSEED to any fixed value in the engine's environment)"
    )


class ActiveConnector:
    """What the facade forwards to while the pool is in use (one role per process)."""

    def __init__(self, vllm_config: Any, scheduler_role: bool, kv_cache_config: Any):
        self.cfg = precheck(vllm_config, kv_cache_config)
        self._kv_cache_config = kv_cache_config
        self._vllm_config = vllm_config
        block_size = compat.block_size(vllm_config, kv_cache_config)
        engine = str(vllm_config.kv_transfer_config.engine_id or "engine")[:8]
        self._scheduler = None
        self._worker = None
        self._load_error_blocks: set[int] = set()
        self.notes: list[str] = []  # limits the pool still serves under (status file, stats)
        if scheduler_role:
            from kvoffload_connector.common.client import PoolClient
            from kvoffload_connector.common.engine_key import engine_key
            from kvoffload_connector.scheduler.offload_scheduler import OffloadScheduler

            _, _, world = compat.world(vllm_config)
            cfg = self.cfg
            client = PoolClient.from_config(cfg, f"{cfg.client_name}/{engine}/scheduler")
            self._scheduler = OffloadScheduler(
                cfg,
                block_size=block_size,
                num_groups=max(1, len(compat.group_block_sizes(kv_cache_config))),
                world_size=world,
                client=client,
                max_num_batched_tokens=int(
                    vllm_config.scheduler_config.max_num_batched_tokens or 8192
                ),
                windows=compat.group_windows(kv_cache_config),
                kv_events=cfg.kv_events and compat.kv_events_enabled(vllm_config),
                engine=engine_key(compat.engine_start(vllm_config)),
                dispatch_inline=compat.in_process_engine(),
            )
            note = restart_note(vllm_config)
            if note:
                self.notes.append(note)
                log.warning("kvoffload: %s", note)
        else:
            from kvoffload_connector.worker.offload_worker import OffloadWorker

            self._worker = OffloadWorker(
                self.cfg,
                vllm_config=vllm_config,
                kv_cache_config=kv_cache_config,
                rank=compat.worker_rank(),
                engine_name=engine,
            )

    # -- scheduler side -------------------------------------------------------------------
    def bind(self, kv_cache_manager: Any, gpu_block_pool: Any = None) -> None:
        if self._scheduler is not None:
            if kv_cache_manager is None and self._scheduler.block_pool is not None:
                return
            self._scheduler.bind(kv_cache_manager, gpu_block_pool)

    def get_num_new_matched_tokens(self, request: Any, num_computed: int):
        return self._scheduler.get_num_new_matched_tokens(request, num_computed)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external)

    def loaded_group_ids(self) -> tuple[int, ...]:
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    def build_connector_meta(self, scheduler_output: Any) -> ConnectorMeta:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.update_connector_output(
            getattr(connector_output, "kv_connector_worker_meta", None)
        )

    def request_finished(self, request: Any, block_ids: tuple[list[int], ...]):
        return self._scheduler.request_finished(request, block_ids)

    def reset_cache(self) -> bool:
        return self._scheduler.reset_cache() if self._scheduler is not None else True

    def take_events(self) -> list[Any]:
        return self._scheduler.take_events() if self._scheduler is not None else []

    def publish_events_through(self, publisher: Any) -> None:
        """KV events reach vLLM's publisher without an engine step where it can (events.py).
        A side channel: whatever goes wrong leaves the step path (`take_events`) in place."""
        if self._scheduler is None or publisher is None:
            return
        try:
            self._scheduler.publish_events_through(publisher)
        except Exception:  # noqa: BLE001 - never costs the pool
            log.debug("kvoffload: KV events stay on the step path", exc_info=True)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_work()

    def on_handshake(self, metadata: Any) -> None:
        """vLLM's `set_xfer_handshake_metadata` at engine start: rank -> `PoolHandshake`."""
        if self._scheduler is None or not metadata:
            return
        shakes = {
            int(rank): m for rank, m in dict(metadata).items() if isinstance(m, PoolHandshake)
        }
        self._scheduler.on_handshake(
            {rank: m.registration for rank, m in shakes.items()},
            {rank: (m.ready, m.usable_end) for rank, m in shakes.items()},
        )

    # -- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from kvoffload_connector.common.engine_key import engine_key

        self._worker.register_kv_caches(kv_caches)
        # The key the scheduler derives too (common/engine_key.py): this rank holds its
        # lock from here on, so the sidecar grants the engine's first step's stores. A key
        # that differs from the scheduler's is replaced at the first step's metadata.
        try:
            self._worker._hold_engine_lock(engine_key(compat.engine_start(self._vllm_config)))
        except Exception:  # noqa: BLE001 - the first step's metadata locks it all the same
            log.debug("kvoffload: no engine lock before the first step", exc_info=True)

    def handshake(self) -> PoolHandshake | None:
        """This rank's registration for its scheduler at engine start (None: no layout)."""
        w = self._worker
        if w is None or w.spec is None or w.layout is None:
            return None
        applied = w._applied
        return PoolHandshake(
            Registration(
                w.spec,
                w.num_ranks,
                w.layout.slot_bytes,
                applied.namespace_id if applied is not None else "",
                applied.generation if applied is not None else "",
            ),
            usable_end=w.usable_end,
            ready=w.ready,
        )

    @staticmethod
    def _meta(md: Any) -> ConnectorMeta | None:
        return md if isinstance(md, ConnectorMeta) else None

    def start_load_kv(self, md: Any) -> None:
        self._worker.start_load_kv(self._meta(md))

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def wait_for_save(self, md: Any) -> None:
        self._worker.wait_for_save(self._meta(md))

    def get_transfer_results(self, md: Any) -> KVConnectorTransferResults:
        # vLLM 0.26 skips `wait_for_save` in steps that schedule no tokens but still binds their
        # metadata and asks for results: submit those stores here, or their GPU blocks stay
        # referenced by the scheduler forever. A no-op where `wait_for_save` ran (0.32+).
        self._worker.wait_for_save(self._meta(md))
        recving, failed, _ = self._worker.transfer_results()
        self._load_error_blocks = self._worker.take_failed_layered_blocks()
        return KVConnectorTransferResults(
            finished_sending=set(), finished_recving=recving, failed_recving=failed
        )

    def get_finished(self, md: Any) -> tuple[set[str] | None, set[str] | None]:
        """vLLM 0.26 entry point: failures go out through get_block_ids_with_load_errors."""
        self._worker.wait_for_save(self._meta(md))
        recving, _, blocks = self._worker.transfer_results()
        self._load_error_blocks = blocks | self._worker.take_failed_layered_blocks()
        return None, recving or None

    def take_load_error_blocks(self) -> set[int]:
        blocks, self._load_error_blocks = self._load_error_blocks, set()
        return blocks

    def build_connector_worker_meta(self) -> Any:
        return self._worker.report() if self._worker is not None else None

    # -- after a hook raised: hand back what vLLM counts on --------------------------------
    def abandon_scheduler(self) -> tuple[int, ...]:
        """Give vLLM back every block reference of ours (`_let_go`); the copies already handed
        to the workers are the fence they finish before their next forward. Best effort: a
        scheduler that cannot tell keeps its references (vLLM's cache is that much smaller)."""
        sched, fence = self._scheduler, ()
        try:
            sched._let_go()
            fence = tuple(sorted(sched._fence))
        except Exception:  # noqa: BLE001
            log.warning("kvoffload: could not give back the pool's block references",
                        exc_info=True)  # fmt: skip
        try:
            sched.shutdown()
        except Exception:  # noqa: BLE001
            log.debug("kvoffload: scheduler shutdown after a fault", exc_info=True)
        return fence

    def abandon_worker(self, debts: Any) -> None:
        """Stop the worker (its copies in flight finish first, so nothing writes into blocks
        vLLM recomputes) and move into `debts` every outcome vLLM or the scheduler still waits
        for: loads not yet reported fail (vLLM recomputes them), stores not yet done fail."""
        w = self._worker
        debts.known |= set(w._jobs) | set(w._done) | set(w._failed)
        try:
            w.shutdown()
        except Exception:  # noqa: BLE001
            log.warning("kvoffload: worker shutdown after a fault", exc_info=True)
        debts.known |= set(w._jobs) | set(w._done) | set(w._failed)
        debts.done.update(w._done)
        for job_id, n in w._failed.items():
            debts.failed[job_id] = debts.failed.get(job_id, 0) + n
        for job_id, (kind, req_id, _, _) in list(w._jobs.items()):
            if kind in ("load", "layered"):
                blocks = w._load_blocks.get(job_id, [])
                debts.fail_load(job_id, req_id, blocks, kind == "layered")
            else:
                debts.failed[job_id] = debts.failed.get(job_id, 0) + 1
        # finished but not yet reported (the copies ended before shutdown returned)
        debts.finished_recving |= w._recving
        debts.failed_recving |= w._failed_recving
        debts.failed_blocks |= w._failed_blocks
        debts.layered_blocks |= w._failed_layered_blocks | self._load_error_blocks

    # -- both -----------------------------------------------------------------------------
    def stats(self) -> Any:
        """Counters since the last call; None (no object built) in the common step where
        nothing was counted: vLLM asks twice per step, so this stays off the step's cost."""
        values: dict[str, float] = {}
        if self._scheduler is not None and self._scheduler.stats_pending():
            from kvoffload_connector.scheduler.offload_scheduler import as_dict

            values.update(as_dict(self._scheduler.take_stats()))
        if self._worker is not None and self._worker.stats_pending():
            for k, v in self._worker.take_stats().items():
                values[k] = values.get(k, 0) + v
        if not values:
            return None
        from kvoffload_connector.stats import ConnectorStats

        stats = ConnectorStats()
        stats.add(values)
        return None if stats.is_empty() else stats

    def no_pool_reason(self) -> str:
        """Why this process serves without the pool now ("" while it uses it): the status
        file's `no_pool`."""
        if self._scheduler is not None:
            return self._scheduler.no_pool_reason()
        if self._worker is not None:
            return self._worker.no_pool_reason()
        return ""

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
