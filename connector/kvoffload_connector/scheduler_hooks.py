"""The facade's scheduler-role hooks: what vLLM's scheduler calls on `KVOffloadConnector`.

Each hook forwards to the live connector (`active.py`) inside a guard: an exception drops the
pool for this process (`KVOffloadConnector._fault`) and the hook answers as without a connector.
What vLLM was promised before a fault stays exact (`fallback.PromisedLoads`). Like the facade,
this module needs only the standard library and vLLM at import.
"""

from __future__ import annotations

import logging
import sys
from types import FrameType
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvoffload_connector import guard

log = logging.getLogger("kvoffload_connector.connector")  # the facade's log, as guard.py's


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


def _undefer_frees(caller: FrameType, block_pool: Any) -> None:
    """Enabled or disabled, our loads are stream-ordered (free_order.py): the scheduler that
    binds us (the caller) frees blocks as without a connector."""
    try:
        from kvoffload_connector.free_order import stop_deferring_block_frees

        stop_deferring_block_frees(caller.f_locals.get("self"), block_pool)
    except Exception:  # noqa: BLE001 - vLLM keeps its own setting
        log.debug("kvoffload: could not check vLLM's deferred block frees", exc_info=True)


class SchedulerHooks:
    """Mixed into `KVOffloadConnector` (connector.py), which sets the state these hooks read:
    `_impl` (the live connector or None), `_promises`, `_lora_to_vllm`, `_events_failed`."""

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
                self._refresh_status()
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
                log.warning("kvoffload: KV events of the host tier are off: %s", guard.reason(exc))
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
