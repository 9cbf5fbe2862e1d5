"""The facade's worker-role hooks: what each vLLM GPU worker calls on `KVOffloadConnector`.

Each hook forwards to the live connector (`active.py`) inside a guard. A rank that lost its pool
(a hook raised, or its KV caches could not be mapped) still answers for the jobs the scheduler
handed it (`fallback.WorkerDebts`): loads fail so vLLM recomputes them, stores are reported
dropped. Like the facade, this module needs only the standard library and vLLM at import.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from kvoffload_connector import guard

log = logging.getLogger("kvoffload_connector.connector")  # the facade's log, as guard.py's


def _empty_results() -> Any:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorTransferResults,
        )

        return KVConnectorTransferResults()
    except Exception:  # noqa: BLE001 - vLLM 0.26 has no such type and never asks
        return None


class WorkerHooks:
    """Mixed into `KVOffloadConnector` (connector.py), which sets the state these hooks read:
    `_impl` (the live connector or None), `_debts`, `disabled_reason`."""

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
            return
        self._refresh_status()  # a rank that found no pool says why from here on

    def _disable_worker(self, exc: BaseException) -> None:
        self.disabled_reason = f"cannot register the KV caches: {guard.reason(exc)}"
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
                report = self._impl.build_connector_worker_meta()
                self._refresh_status()
                return report
            except Exception as exc:  # noqa: BLE001
                self._fault("build_connector_worker_meta", exc)
        if self._debts is None:
            return None
        try:
            self._owed_meta()
            return self._debts.report()
        except Exception:  # noqa: BLE001
            return None
