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


def _event_publisher(frame: FrameType | None) -> Any:
    """vLLM's scheduler's KV-event publisher, from the frames that bind us (the scheduler is
    the `self` of one of the nearest callers; vLLM 0.26-0.33 create the publisher first)."""
    for _ in range(4):
        if frame is None:
            return None
        publisher = getattr(frame.f_locals.get("self"), "kv_event_publisher", None)
        if publisher is not None:
            return publisher
        frame = frame.f_back
    return None


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
            self.disabled_reason = _reason(exc)
            log.debug("kvoffload: connector construction failed", exc_info=True)
            guard.say_disabled(self.disabled_reason)
        self._write_status()

    def _write_status(self) -> None:
        extra = None
        if self._scheduler_role:
            extra = self._status_extra(self._config_for_status, self._kv_cache_config_for_status)
        if self.fault:
            extra = {**(extra or {}), "fault": self.fault}
        guard.write_status(
            _socket_of(self._config_for_status),
            "active" if self._impl is not None else "disabled",
            self.disabled_reason,
            self._role_name,
            self._rank,
            _vllm_version(),
            extra,
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
        self.disabled_reason = f"{hook} raised {_reason(exc)}"
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

    def _lora_left_to_vllm(self, request: Any) -> bool:
        """A LoRA request where vLLM's block hashes name the adapter only by name (0.26): one
        name re-pointed at other weights would share keys, so the pool stays out of it."""
        if getattr(request, "lora_request", None) is None:
            return False
        if self._lora_to_vllm is None:
            from kvoffload_connector.common.compat import lora_hashes_name_the_adapter

            self._lora_to_vllm = not lora_hashes_name_the_adapter()
            if self._lora_to_vllm:
                log.warning(
                    "kvoffload: this vLLM's block hashes name a LoRA adapter only by its name: "
                    "LoRA requests are served without the pool"
                )
        return self._lora_to_vllm

    # -- scheduler side -------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        _undefer_frees(sys._getframe(1), getattr(kv_cache_manager, "block_pool", None))
        if self._impl is not None:
            try:
                self._inject("bind_kv_cache_manager")
                self._impl.bind(kv_cache_manager)
                self._impl.publish_events_through(_event_publisher(sys._getframe(1)))
            except Exception as exc:  # noqa: BLE001
                self._fault("bind_kv_cache_manager", exc)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """vLLM 0.26 calls only this one (0.32+ also bind_kv_cache_manager)."""
        _undefer_frees(sys._getframe(1), gpu_block_pool)
        if self._impl is not None:
            try:
                self._inject("bind_gpu_block_pool")
                self._impl.bind(None, gpu_block_pool)
                self._impl.publish_events_through(_event_publisher(sys._getframe(1)))
            except Exception as exc:  # noqa: BLE001
                self._fault("bind_gpu_block_pool", exc)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._impl is None or self._lora_left_to_vllm(request):
            return 0, False
        try:
            self._inject("get_num_new_matched_tokens")
            answer = self._impl.get_num_new_matched_tokens(request, num_computed_tokens)
            self._promises.promised(request, num_computed_tokens, answer)
            return answer
        except Exception as exc:  # noqa: BLE001 - nothing promised for this request yet
            self._fault("get_num_new_matched_tokens", exc)
            return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        """Also after a fault: a load promised before it is owed (vLLM counts on it)."""
        try:
            if self._promises is not None:
                self._promises.allocated(request, blocks, num_external_tokens)
            if self._impl is not None:
                self._inject("update_state_after_alloc")
                self._impl.update_state_after_alloc(request, blocks, num_external_tokens)
        except Exception as exc:  # noqa: BLE001 - the owed load fails on the workers
            self._fault("update_state_after_alloc", exc)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        if self._impl is not None:
            try:
                return self._impl.loaded_group_ids()
            except Exception as exc:  # noqa: BLE001
                self._fault("get_loaded_kv_cache_group_ids", exc)
        return super().get_loaded_kv_cache_group_ids(request)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        if self._impl is not None:
            try:
                self._inject("build_connector_meta")
                meta = self._impl.build_connector_meta(scheduler_output)
                self._promises.shipped()
                return meta
            except Exception as exc:  # noqa: BLE001 - the owed loads leave as failing jobs
                self._fault("build_connector_meta", exc)
        if self._promises is not None:
            try:
                meta = self._promises.failing_meta()
                if meta is not None:
                    return meta
            except Exception:  # noqa: BLE001
                log.warning("kvoffload: cannot fail the loads owed to vLLM", exc_info=True)
        return KVConnectorMetadata()

    def update_connector_output(self, connector_output: Any) -> None:
        if self._impl is not None:
            try:
                self._inject("update_connector_output")
                self._impl.update_connector_output(connector_output)
            except Exception as exc:  # noqa: BLE001
                self._fault("update_connector_output", exc)

    def reset_cache(self) -> bool:
        """vLLM's `reset_connector` (a weight update; `pause_generation` and `sleep` clearing
        caches): nothing stored in the pool before is used again. True also without the pool
        (nothing cached): vLLM would otherwise report its whole reset as failed."""
        if self._impl is not None:
            try:
                self._inject("reset_cache")
                return self._impl.reset_cache()
            except Exception as exc:  # noqa: BLE001 - without the pool nothing old is used
                self._fault("reset_cache", exc)
        return True

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
        return self._finished("request_finished", request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished("request_finished_all_groups", request, block_ids)

    def _finished(self, hook: str, request: Any, block_ids: Any) -> tuple[bool, Any]:
        """Never delays the free (nothing of ours is sent to a client)."""
        try:
            if self._promises is not None:
                self._promises.forget(request.request_id)
            if self._impl is not None and not self._lora_left_to_vllm(request):
                self._inject(hook)
                return self._impl.request_finished(request, block_ids)
        except Exception as exc:  # noqa: BLE001
            self._fault(hook, exc)
        return False, None

    def has_pending_push_work(self) -> bool:
        """Also after a fault, until the loads owed to vLLM have gone out to fail."""
        if self._impl is not None:
            try:
                return self._impl.has_pending_push_work()
            except Exception as exc:  # noqa: BLE001
                self._fault("has_pending_push_work", exc)
        return self._promises is not None and self._promises.pending()

    def set_xfer_handshake_metadata(self, metadata: Any) -> None:
        """vLLM hands the scheduler its workers' handshake metadata at engine start (rank ->
        what `get_handshake_metadata` gave): the scheduler registers from it in the background,
        before any step. A side channel: missed, the first step's report still carries it."""
        if self._impl is not None:
            try:
                self._impl.on_handshake(metadata)
            except Exception:  # noqa: BLE001 - the step's report registers all the same
                log.debug("kvoffload: handshake metadata not used", exc_info=True)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: Any) -> None:
        """Keyed by (pp_rank, tp_rank): every stage's ranks registered alike."""
        try:
            ranks = {i: m for i, (_, m) in enumerate(sorted(dict(metadata).items()))}
        except Exception:  # noqa: BLE001
            ranks = {}
        self.set_xfer_handshake_metadata(ranks)

    # -- worker side ----------------------------------------------------------------------
    def get_handshake_metadata(self) -> Any:
        """This rank's registration for the scheduler, collected by vLLM at engine start."""
        if self._impl is None:
            return None
        try:
            return self._impl.handshake()
        except Exception:  # noqa: BLE001 - the first step's report carries it instead
            log.debug("kvoffload: no handshake metadata", exc_info=True)
            return None

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Maps this rank's pool for its KV caches. A layout the connector cannot map (a KV
        cache shape of a vLLM or model it was not written for) must not stop vLLM: this rank
        then serves without the pool, and tells the scheduler so requests never wait for it."""
        if self._impl is None:
            return
        try:
            self._inject("register_kv_caches")
            self._impl.register_kv_caches(kv_caches)
        except Exception as exc:  # noqa: BLE001 - no job ran yet: dropping the rank is safe
            self._disable_worker(exc)

    def _disable_worker(self, exc: BaseException) -> None:
        self.disabled_reason = f"cannot register the KV caches: {_reason(exc)}"
        log.debug("kvoffload: register_kv_caches failed", exc_info=True)
        guard.say_disabled(self.disabled_reason)
        impl, self._impl = self._impl, None
        self._debts = self._new_debts()  # the scheduler hears why; stray jobs are failed
        with contextlib.suppress(Exception):  # best effort: nothing was mapped or submitted
            impl.shutdown()
        self._write_status()

    def _worker_hook(self, hook: str, call: Any) -> bool:
        """Run a worker hook on the pool; False when the pool is gone (before or now)."""
        if self._impl is None:
            return False
        try:
            self._inject(hook)
            call(self._impl)
            return True
        except Exception as exc:  # noqa: BLE001 - its loads fail (recomputed), stores drop
            self._fault(hook, exc)
            return False

    def _owed_meta(self) -> None:
        if self._debts is not None:
            self._debts.take_meta(self._connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        md = self._connector_metadata
        if not self._worker_hook("start_load_kv", lambda impl: impl.start_load_kv(md)):
            self._owed_meta()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Async loads: nothing (the request waited in WAITING_FOR_REMOTE_KVS). Layered loads:
        this layer's attention runs after its bytes arrived (a GPU-side wait)."""
        if self._impl is not None:
            try:
                self._impl.wait_for_layer_load(layer_name)
            except Exception as exc:  # noqa: BLE001 - the step's layered loads fail
                self._fault("wait_for_layer_load", exc)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # stores are submitted once per step in wait_for_save

    def wait_for_save(self) -> None:
        md = self._connector_metadata
        if not self._worker_hook("wait_for_save", lambda impl: impl.wait_for_save(md)):
            self._owed_meta()

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        if self._impl is not None:
            try:
                self._inject("get_transfer_results")
                return self._impl.get_transfer_results(self._connector_metadata)
            except Exception as exc:  # noqa: BLE001
                self._fault("get_transfer_results", exc)
        if self._debts is None:
            return _empty_results()
        self._owed_meta()
        recving, failed, _, layered = self._debts.transfer_results()
        self._debts.layered_blocks = layered  # get_block_ids_with_load_errors reports them
        try:
            from kvoffload_connector.common.compat import KVConnectorTransferResults

            return KVConnectorTransferResults(
                finished_sending=set(), finished_recving=recving, failed_recving=failed
            )
        except Exception:  # noqa: BLE001
            return _empty_results()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """vLLM 0.26 entry point: failures go out through get_block_ids_with_load_errors."""
        if self._impl is not None:
            try:
                self._inject("get_finished")
                return self._impl.get_finished(self._connector_metadata)
            except Exception as exc:  # noqa: BLE001
                self._fault("get_finished", exc)
        if self._debts is None:
            return None, None
        self._owed_meta()
        recving, _, blocks, layered = self._debts.transfer_results()
        self._debts.layered_blocks = blocks | layered
        return None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._impl is not None:
            try:
                self._inject("get_block_ids_with_load_errors")
                return self._impl.take_load_error_blocks()
            except Exception as exc:  # noqa: BLE001
                self._fault("get_block_ids_with_load_errors", exc)
        if self._debts is None:
            return set()
        blocks, self._debts.layered_blocks = self._debts.layered_blocks, set()
        return blocks

    def build_connector_worker_meta(self) -> Any:
        if self._impl is not None:
            try:
                self._inject("build_connector_worker_meta")
                return self._impl.build_connector_worker_meta()
            except Exception as exc:  # noqa: BLE001
                self._fault("build_connector_worker_meta", exc)
        if self._debts is None:
            return None
        try:
            self._owed_meta()
            return self._debts.report()
        except Exception:  # noqa: BLE001
            return None

    # -- both -----------------------------------------------------------------------------
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
                reason = _reason(exc)
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
