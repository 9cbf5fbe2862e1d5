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
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
)

from kvoffload_connector import guard
from kvoffload_connector.scheduler_hooks import SchedulerHooks
from kvoffload_connector.worker_hooks import WorkerHooks

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


def _socket_of(vllm_config: Any) -> str:
    try:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        socket = extra.get("socket")
        return socket if isinstance(socket, str) and socket else DEFAULT_SOCKET
    except Exception:  # noqa: BLE001
        return DEFAULT_SOCKET


def _placement_of(vllm_config: Any) -> str:
    """The configured placement as written ("pod" when unset), even in a config that failed."""
    try:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        placement = extra.get("placement", "pod")
        return placement if isinstance(placement, str) else repr(placement)
    except Exception:  # noqa: BLE001
        return "pod"


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


class KVOffloadConnector(SchedulerHooks, WorkerHooks, KVConnectorBase_V1, SupportsHMA):
    """kvoffload's KV connector: a best-effort host-memory tier behind a sidecar.

    Every hook is guarded: an exception inside one (a bug, a state nobody foresaw) drops the
    pool for this process, said once with its traceback, in the status file and the
    `hook_faults` counter, and vLLM serves on as without a connector. What vLLM was already
    promised is kept exact (`fallback.py`): loads it counts on are reported failed, so it
    recomputes those blocks, and the jobs the scheduler counts on are reported."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        self._impl: Any = None
        self.disabled_reason = ""
        self.fault = ""  # the hook that raised, once one did
        self._config_for_status = vllm_config
        self._kv_cache_config_for_status = kv_cache_config
        self._promises: Any = None  # fallback.PromisedLoads (scheduler side, active)
        self._debts: Any = None  # fallback.WorkerDebts (worker side, once its pool is gone)
        self._fault_stats: dict[str, float] = {}
        self._lora_to_vllm: bool | None = None  # LoRA requests left to vLLM (compat)
        self._events_failed = False  # take_events raised once: said, and quiet since
        self._no_pool_said = ""  # why the pool is not used now, as the status file says it
        self._scheduler_role = scheduler_role = role == KVConnectorRole.SCHEDULER
        self._role_name = "scheduler" if scheduler_role else "worker"
        self._rank = 0
        try:
            from kvoffload_connector.active import ActiveConnector

            if not scheduler_role:
                from kvoffload_connector.common.compat import worker_rank

                self._rank = worker_rank()
            self._impl = ActiveConnector(vllm_config, scheduler_role, kv_cache_config)
            self.cfg = self._impl.cfg
            if scheduler_role:
                from kvoffload_connector.common.compat import block_size
                from kvoffload_connector.fallback import PromisedLoads

                self._promises = PromisedLoads(block_size(vllm_config, kv_cache_config))
        except Exception as exc:  # noqa: BLE001 - never crash vLLM: serve without the pool
            if self._impl is not None:
                with contextlib.suppress(Exception):
                    self._impl.shutdown()
            self._impl = None
            self.disabled_reason = guard.reason(exc)
            log.debug("kvoffload: connector construction failed", exc_info=True)
            guard.say_disabled(self.disabled_reason)
        self._write_status()

    def _write_status(self) -> None:
        extra = None
        if self._scheduler_role:
            extra = self._status_extra(self._config_for_status, self._kv_cache_config_for_status)
        if self.fault:
            extra = {**(extra or {}), "fault": self.fault}
        extra = {**(extra or {}), "placement": _placement_of(self._config_for_status)}
        if self._no_pool_said and self._impl is not None:
            extra["no_pool"] = self._no_pool_said
        guard.write_status(
            _socket_of(self._config_for_status),
            "active" if self._impl is not None else "disabled",
            self.disabled_reason,
            self._role_name,
            self._rank,
            _vllm_version(),
            extra,
        )

    def _refresh_status(self) -> None:
        """At a step (and once a rank registered): rewrite the status file when why the pool
        is not used changed (a rank that found no pool, a sidecar or node agent away or back),
        so `kvoffload stats` and the pod's status file say it while it lasts."""
        try:
            reason = self._impl.no_pool_reason() if self._impl is not None else ""
        except Exception:  # noqa: BLE001 - a status detail must never stop vLLM
            return
        if reason != self._no_pool_said:
            self._no_pool_said = reason
            self._write_status()

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

    # -- a hook that raised ----------------------------------------------------------------
    def _inject(self, hook: str) -> None:
        """Tests only (guard.FAULT_ENV): raise where a test asks; one flag test otherwise."""
        if guard._FAULT:
            owed = self._promises is not None and bool(self._promises.owed)
            guard.check_test_fault(hook, owed)

    def _fault(self, hook: str, exc: BaseException) -> None:
        """`hook` raised: drop the pool for this process and serve on without it."""
        impl, self._impl = self._impl, None
        self.fault = hook
        self.disabled_reason = f"{hook} raised {guard.reason(exc)}"
        guard.say_disabled(self.disabled_reason, exc)
        self._fault_stats["hook_faults"] = self._fault_stats.get("hook_faults", 0) + 1
        if impl is not None:
            try:
                if self._scheduler_role:
                    fence = impl.abandon_scheduler()
                    if self._promises is not None:
                        self._promises.fence = fence
                else:
                    self._debts = self._new_debts()
                    impl.abandon_worker(self._debts)
            except Exception:  # noqa: BLE001
                log.warning("kvoffload: cleaning up after %s failed", hook, exc_info=True)
        self._write_status()

    def _new_debts(self) -> Any:
        from kvoffload_connector.fallback import WorkerDebts

        return WorkerDebts(reason=self.disabled_reason, rank=self._rank)

    # -- both roles: stats, metrics, shutdown --------------------------------------------------
    def get_kv_connector_stats(self) -> Any:
        stats = None
        if self._impl is not None:
            try:
                stats = self._impl.stats()
            except Exception as exc:  # noqa: BLE001
                self._fault("get_kv_connector_stats", exc)
        if self._fault_stats:
            try:
                from kvoffload_connector.stats import ConnectorStats

                faults = ConnectorStats(data=dict(self._fault_stats))
                self._fault_stats = {}
                return faults if stats is None else stats.aggregate(faults)
            except Exception:  # noqa: BLE001
                pass
        return stats

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
                reason = guard.reason(exc)
            return PromMetrics(
                vllm_config, metric_types, labelnames, per_engine_labelvalues, reason=reason
            )
        except Exception:  # noqa: BLE001
            log.debug("kvoffload: no Prometheus metrics", exc_info=True)
            return None

    def shutdown(self) -> None:
        if self._impl is not None:
            try:
                self._impl.shutdown()
            except Exception:  # noqa: BLE001 - vLLM is going away: say it, never raise
                log.warning("kvoffload: connector shutdown failed", exc_info=True)
