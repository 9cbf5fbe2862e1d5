"""How a worker rank's stores end: committed without a step, and the drained word.

Stores commit without a step: a completion thread per rank waits in the engine
(`wait_for_store`, no GIL held) and handles what finished exactly as the step's poll would,
under the job lock, so the last request before a quiet period, a shutdown or a crash reaches
the pool without another request; each job still goes into one report, once. Commits go to the
sidecar on the RPC thread.

After a sidecar restart the new instance withholds the slots it found reserved for this
engine (a copy of ours may still land in them). Each rank tells it, over its own registration
(`Drained`), once it has no store copy in flight that names another sidecar instance; from
then on it refuses every store job naming an instance other than that one (or a later
registration's), so the word stays true and the instance frees those slots once every rank
said it (docs/POOL.md, the invariant).
"""

from __future__ import annotations

import logging
import threading

from kvoffload_connector.common.client import PoolUnavailable
from kvoffload_connector.worker.job_lock import jobs_locked

log = logging.getLogger(__name__)

# how long the completion thread waits in the engine per round, and shutdown for that thread
_COMPLETION_WAIT_S = 0.5
_COMPLETION_JOIN_S = 2.0


class StoreCompletion:
    """Mixed into `OffloadWorker` (offload_worker.py), which owns the state: the job tables,
    `_jobs_lock` and its condition, the RPC thread, the client and the applied registration."""

    def _may_store(self, epoch: int) -> bool:
        """Job lock held: a store job naming sidecar instance `epoch` may start its copies:
        always until this rank reported drained; afterwards only for the instance it reported
        to, or the one it is registered with now (the earlier one is gone)."""
        drained, reg = self._drained_epoch, self._applied
        return not drained or epoch == drained or (reg is not None and epoch == reg.epoch)

    @jobs_locked
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

    def _commit(self, namespace_id: str, store_id: int, epoch: int = 0, engine: int = 0) -> None:
        try:
            self.client.commit_store(namespace_id, store_id, self.rank, epoch=epoch, engine=engine)
        except PoolUnavailable as e:
            log.debug("kvoffload: commit of store %d dropped: %s", store_id, e)
