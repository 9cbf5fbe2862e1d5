"""The vLLM facade: builds the config, then forwards to the scheduler or worker half.

Load with:
    kv_transfer_config = {"kv_connector": "KVOffloadConnector",
                          "kv_connector_module_path": "kvoffload_connector.connector",
                          "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                          "kv_connector_extra_config": {"socket": "/kvoffload/run/pool.sock"}}
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvoffload_connector import compat
from kvoffload_connector.compat import KVConnectorTransferResults
from kvoffload_connector.config import parse_extra_config
from kvoffload_connector.metadata import ConnectorMeta
from kvoffload_connector.stats import ConnectorStats, PromMetrics

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def _share_vllm_log_handlers() -> None:
    """Our modules log under `kvoffload_connector`; print them where vLLM prints its own."""
    ours = logging.getLogger("kvoffload_connector")
    if ours.handlers:
        return
    vllm_logger = logging.getLogger("vllm")
    for h in vllm_logger.handlers:
        ours.addHandler(h)
    ours.setLevel(vllm_logger.level or logging.INFO)


_share_vllm_log_handlers()


class KVOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    """kvoffload's KV connector: a best-effort host-memory tier behind a sidecar."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        block_size = compat.block_size(vllm_config, kv_cache_config)
        sizes = set(compat.group_block_sizes(kv_cache_config))
        if len(sizes) > 1:
            raise ValueError(f"kvoffload needs one block size for all KV groups, got {sizes}")
        self.cfg = parse_extra_config(extra, block_size)
        engine = str(self._kv_transfer_config.engine_id or "engine")[:8]
        self._scheduler = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from kvoffload_connector.client import PoolClient
            from kvoffload_connector.scheduler import OffloadScheduler

            _, _, world = compat.world(vllm_config)
            cfg = self.cfg
            client = PoolClient(
                cfg.socket,
                f"{cfg.client_name}/{engine}/scheduler",
                rpc_timeout_s=cfg.rpc_timeout_ms / 1e3,
                reconnect_min_s=cfg.reconnect_min_ms / 1e3,
                reconnect_max_s=cfg.reconnect_max_ms / 1e3,
                framed=cfg.framed_session,
            )
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
            )
        else:
            from kvoffload_connector.worker import OffloadWorker

            self._worker = OffloadWorker(
                self.cfg,
                vllm_config=vllm_config,
                kv_cache_config=kv_cache_config,
                rank=compat.worker_rank(),
                engine_name=engine,
            )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # best-effort cache: a dropped store is a future miss

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """No: where vLLM may replay full CUDA graphs (which skip `wait_for_layer_load`), the
        worker makes the compute stream wait for a step's whole layered load before the
        forward instead, so decode keeps its full graphs and loads stay correct."""
        return False

    # -- scheduler side -------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.bind(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """vLLM 0.26 calls only this one (0.32+ also bind_kv_cache_manager)."""
        if self._scheduler is not None and self._scheduler.block_pool is None:
            self._scheduler.bind(None, gpu_block_pool)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.update_connector_output(
            getattr(connector_output, "kv_connector_worker_meta", None)
        )

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_work()

    # -- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Async loads: nothing (the request waited in WAITING_FOR_REMOTE_KVS). Layered loads:
        this layer's attention runs after its bytes arrived (a GPU-side wait)."""
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # stores are submitted once per step in wait_for_save

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._meta())

    def _meta(self) -> ConnectorMeta | None:
        md = self._connector_metadata
        return md if isinstance(md, ConnectorMeta) else None

    def _submit_unsaved_stores(self) -> None:
        """vLLM 0.26 skips `wait_for_save` in steps that schedule no tokens but still binds their
        metadata and asks for results: submit those stores here, or their GPU blocks stay
        referenced by the scheduler forever (the engine stalls once the cache is full).
        A no-op where `wait_for_save` ran for the bound metadata (vLLM 0.32+)."""
        self._worker.wait_for_save(self._meta())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        self._submit_unsaved_stores()
        recving, failed, _ = self._worker.transfer_results()
        self._load_error_blocks = self._worker.take_failed_layered_blocks()
        return KVConnectorTransferResults(
            finished_sending=set(), finished_recving=recving, failed_recving=failed
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """vLLM 0.26 entry point: failures go out through get_block_ids_with_load_errors."""
        self._submit_unsaved_stores()
        recving, _, blocks = self._worker.transfer_results()
        self._load_error_blocks = blocks | self._worker.take_failed_layered_blocks()
        return None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        blocks = getattr(self, "_load_error_blocks", set())
        self._load_error_blocks = set()
        return blocks

    def build_connector_worker_meta(self) -> Any:
        return self._worker.report() if self._worker is not None else None

    # -- both -----------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> ConnectorStats | None:
        """Counters since the last call; None (no object built) in the common step where
        nothing was counted: vLLM asks twice per step, so this stays off the step's cost."""
        values: dict[str, float] = {}
        if self._scheduler is not None and self._scheduler.stats_pending():
            from kvoffload_connector.scheduler import as_dict

            values.update(as_dict(self._scheduler.take_stats()))
        if self._worker is not None and self._worker.stats_pending():
            for k, v in self._worker.take_stats().items():
                values[k] = values.get(k, 0) + v
        if not values:
            return None
        stats = ConnectorStats()
        stats.add(values)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> ConnectorStats | None:
        return ConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return PromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
