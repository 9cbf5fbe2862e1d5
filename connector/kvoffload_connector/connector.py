"""The module vLLM imports: a facade that can never crash vLLM.

Load with:
    kv_transfer_config = {"kv_connector": "KVOffloadConnector",
                          "kv_connector_module_path": "kvoffload_connector.connector",
                          "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                          "kv_connector_extra_config": {"socket": "/kvoffload/run/pool.sock"}}

At import it needs only the standard library and vLLM's own base classes. Everything else
(config, grpc, protobuf, our stubs, numpy, torch-side transfers) is built in `active.py` inside
a guard: whatever goes wrong there (a bad config value, a package that cannot import, an
unsupported model or vLLM version) leaves the connector disabled, where every hook answers as if
no connector were configured, and the reason is said once: a log line, a status file beside the
pool socket for `kvoffload stats`, and the `vllm:kvoffload_pool_active` gauge.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from types import FrameType
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvoffload_connector import guard

log = logging.getLogger(__name__)
DEFAULT_SOCKET = "/kvoffload/run/pool.sock"


def _share_vllm_log_handlers() -> None:
    """Our modules log under `kvoffload_connector`; print them where vLLM prints its own, and
    only there (as vLLM's own logger does): a root handler that something else in the process
    installed would print each line twice (vLLM 0.26's engine core on the GPU image did)."""
    ours = logging.getLogger("kvoffload_connector")
    if ours.handlers:
        return
    vllm_logger = logging.getLogger("vllm")
    for h in vllm_logger.handlers:
        ours.addHandler(h)
    ours.setLevel(vllm_logger.level or logging.INFO)
    ours.propagate = not ours.handlers


_share_vllm_log_handlers()


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if type(exc).__name__ == "Unsupported":
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _socket_of(vllm_config: Any) -> str:
    try:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        socket = extra.get("socket")
        return socket if isinstance(socket, str) and socket else DEFAULT_SOCKET
    except Exception:  # noqa: BLE001
        return DEFAULT_SOCKET


def _vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:  # noqa: BLE001
        return "unknown"


def _gpu_capacity(vllm_config: Any, kv_cache_config: Any) -> dict[str, Any]:
    """The GPU tier's KV capacity for the status file (the sidecar's capacity metrics)."""
    try:
        from kvoffload_connector.capacity import gpu_capacity

        return gpu_capacity(vllm_config, kv_cache_config)
    except Exception:  # noqa: BLE001 - a status detail must never stop vLLM
        return {}


def _empty_results() -> Any:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorTransferResults,
        )

        return KVConnectorTransferResults()
    except Exception:  # noqa: BLE001 - vLLM 0.26 has no such type and never asks
        return None


def _undefer_frees(caller: FrameType, block_pool: Any) -> None:
    """Enabled or disabled, our loads are stream-ordered (free_order.py): the scheduler that
    binds us (the caller) frees blocks as without a connector."""
    try:
        from kvoffload_connector.free_order import stop_deferring_block_frees

        stop_deferring_block_frees(caller.f_locals.get("self"), block_pool)
    except Exception:  # noqa: BLE001 - vLLM keeps its own setting
        log.debug("kvoffload: could not check vLLM's deferred block frees", exc_info=True)


class KVOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    """kvoffload's KV connector: a best-effort host-memory tier behind a sidecar."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        self._impl: Any = None
        self.disabled_reason = ""
        self._config_for_status = vllm_config
        self._pending_no_pool = ""  # sent once to the scheduler after this rank lost its pool
        self._events_failed = False  # take_events raised once: said, and quiet since
        scheduler_role = role == KVConnectorRole.SCHEDULER
        role_name = "scheduler" if scheduler_role else "worker"
        rank = 0
        try:
            from kvoffload_connector.active import ActiveConnector

            if not scheduler_role:
                from kvoffload_connector.compat import worker_rank

                rank = worker_rank()
            self._impl = ActiveConnector(vllm_config, scheduler_role, kv_cache_config)
            self.cfg = self._impl.cfg
        except Exception as exc:  # noqa: BLE001 - never crash vLLM: serve without the pool
            self._impl = None
            self.disabled_reason = _reason(exc)
            log.debug("kvoffload: connector construction failed", exc_info=True)
            guard.say_disabled(self.disabled_reason)
        guard.write_status(
            _socket_of(vllm_config),
            "active" if self._impl is not None else "disabled",
            self.disabled_reason,
            role_name,
            rank,
            _vllm_version(),
            self._status_extra(vllm_config, kv_cache_config) if scheduler_role else None,
        )

    def _status_extra(self, vllm_config: Any, kv_cache_config: Any) -> dict[str, Any]:
        """The scheduler's further status fields: the GPU KV capacity, and notes on limits the
        pool serves under (`ActiveConnector.notes`)."""
        notes = self._impl.notes if self._impl is not None else []
        return {
            **_gpu_capacity(vllm_config, kv_cache_config),
            **({"notes": notes} if notes else {}),
        }

    @property
    def active(self) -> bool:
        return self._impl is not None

    @property
    def _scheduler(self) -> Any:
        """The scheduler half (None when disabled or a worker): diagnostics, benchmarks."""
        return getattr(self._impl, "_scheduler", None)

    @property
    def _worker(self) -> Any:
        return getattr(self._impl, "_worker", None)

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
        _undefer_frees(sys._getframe(1), getattr(kv_cache_manager, "block_pool", None))
        if self._impl is not None:
            self._impl.bind(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """vLLM 0.26 calls only this one (0.32+ also bind_kv_cache_manager)."""
        _undefer_frees(sys._getframe(1), gpu_block_pool)
        if self._impl is not None:
            self._impl.bind(None, gpu_block_pool)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._impl is None:
            return 0, False
        return self._impl.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        if self._impl is not None:
            self._impl.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        if self._impl is None:
            return super().get_loaded_kv_cache_group_ids(request)
        return self._impl.loaded_group_ids()

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        if self._impl is None:
            return KVConnectorMetadata()
        return self._impl.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._impl is not None:
            self._impl.update_connector_output(connector_output)

    def reset_cache(self) -> bool:
        """vLLM's `reset_connector` (a weight update; `pause_generation` and `sleep` clearing
        caches): nothing stored in the pool before is used again. True also without the pool
        (nothing cached): vLLM would otherwise report its whole reset as failed."""
        if self._impl is None:
            return True
        return self._impl.reset_cache()

    def take_events(self) -> Any:
        """The host tier's BlockStored/BlockRemoved (medium "CPU") for vLLM's KV-events
        publisher; nothing when disabled, and nothing (said once) when building them fails."""
        if self._impl is None:
            return ()
        try:
            return self._impl.take_events()
        except Exception as exc:  # noqa: BLE001 - events are a side channel: never stop vLLM
            if not self._events_failed:
                self._events_failed = True
                log.warning("kvoffload: KV events of the host tier are off: %s", _reason(exc))
            return ()

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._impl is None:
            return False, None
        return self._impl.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._impl is None:
            return False, None
        return self._impl.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._impl is not None and self._impl.has_pending_push_work()

    # -- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Maps this rank's pool for its KV caches. A layout the connector cannot map (a KV
        cache shape of a vLLM or model it was not written for) must not stop vLLM: this rank
        then serves without the pool, and tells the scheduler so requests never wait for it."""
        if self._impl is None:
            return
        try:
            self._impl.register_kv_caches(kv_caches)
        except Exception as exc:  # noqa: BLE001 - no job ran yet: dropping the rank is safe
            self._disable_worker(exc)

    def _disable_worker(self, exc: BaseException) -> None:
        self.disabled_reason = f"cannot register the KV caches: {_reason(exc)}"
        log.debug("kvoffload: register_kv_caches failed", exc_info=True)
        guard.say_disabled(self.disabled_reason)
        impl, self._impl = self._impl, None
        self._pending_no_pool = self.disabled_reason
        with contextlib.suppress(Exception):  # best effort: nothing was mapped or submitted
            impl.shutdown()
        try:
            from kvoffload_connector.compat import worker_rank

            rank = worker_rank()
        except Exception:  # noqa: BLE001
            rank = 0
        guard.write_status(
            _socket_of(self._config_for_status),
            "disabled",
            self.disabled_reason,
            "worker",
            rank,
            _vllm_version(),
        )

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._impl is not None:
            self._impl.start_load_kv(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Async loads: nothing (the request waited in WAITING_FOR_REMOTE_KVS). Layered loads:
        this layer's attention runs after its bytes arrived (a GPU-side wait)."""
        if self._impl is not None:
            self._impl.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # stores are submitted once per step in wait_for_save

    def wait_for_save(self) -> None:
        if self._impl is not None:
            self._impl.wait_for_save(self._connector_metadata)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        if self._impl is None:
            return _empty_results()
        return self._impl.get_transfer_results(self._connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """vLLM 0.26 entry point: failures go out through get_block_ids_with_load_errors."""
        if self._impl is None:
            return None, None
        return self._impl.get_finished(self._connector_metadata)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._impl is None:
            return set()
        return self._impl.take_load_error_blocks()

    def build_connector_worker_meta(self) -> Any:
        if self._impl is None:
            return self._take_no_pool_report()
        return self._impl.build_connector_worker_meta()

    def _take_no_pool_report(self) -> Any:
        """Once, after this rank gave up its pool: a report telling the scheduler so."""
        reason, self._pending_no_pool = self._pending_no_pool, ""
        if not reason:
            return None
        try:
            from kvoffload_connector.metadata import WorkerReport

            return WorkerReport(no_pool=reason)
        except Exception:  # noqa: BLE001
            return None

    # -- both -----------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> Any:
        return None if self._impl is None else self._impl.stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        try:
            from kvoffload_connector.stats import ConnectorStats

            return ConnectorStats(data=dict(data or {}))
        except Exception:  # noqa: BLE001
            return None

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        """Our counters plus `vllm:kvoffload_pool_active` (1, or 0 with the reason: what this
        process can check without the engine's KV cache config). Never raises."""
        try:
            from kvoffload_connector.stats import PromMetrics

            reason = ""
            try:
                from kvoffload_connector.active import precheck

                precheck(vllm_config)
            except Exception as exc:  # noqa: BLE001
                reason = _reason(exc)
            return PromMetrics(
                vllm_config, metric_types, labelnames, per_engine_labelvalues, reason=reason
            )
        except Exception:  # noqa: BLE001
            log.debug("kvoffload: no Prometheus metrics", exc_info=True)
            return None

    def shutdown(self) -> None:
        if self._impl is not None:
            self._impl.shutdown()
