"""The jobs handed to the workers, and their GPU block references (no torch).

A job (load or store) holds a reference (`BlockPool.touch`) on its GPU blocks until every rank
reported it done or failed, so no block is reused before its copy finished: this fences request
completion, preemption and sliding-window frees alike. Then a load's pins go back and a store
that any rank failed is aborted. Part of `OffloadScheduler` (scheduler.py).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from kvoffload_connector.common.client import PoolUnavailable

# the scheduler side logs as one logger, whichever part of it speaks
log = logging.getLogger("kvoffload_connector.scheduler")


@dataclass
class Job:
    job_id: int
    kind: str  # "load" | "store"
    req_ids: tuple[str, ...]
    blocks: list[Any]  # KVCacheBlocks holding a reference for this job
    pins: list[int] = field(default_factory=list)
    store_id: int = 0
    namespace_id: str = ""
    epoch: int = 0  # the sidecar instance that answered the store's reservation
    chunks: int = 0
    done: int = 0
    failed: int = 0


class JobTable:
    """Block references and completion of jobs (a part of `OffloadScheduler`)."""

    def _touch(self, blocks: list[Any]) -> None:
        if self.block_pool is not None and blocks:
            self.block_pool.touch(blocks)

    def _untouch(self, blocks: list[Any]) -> None:
        if self.block_pool is not None and blocks:
            self.block_pool.free_blocks(blocks)

    def _maybe_complete(self, job: Job) -> None:
        if job.done + job.failed < self.world_size:
            return
        del self._jobs[job.job_id]
        self._fence.discard(job.job_id)
        self._untouch(job.blocks)
        if job.kind == "load":
            self._release(job.pins)
            st = self._reqs.get(job.req_ids[0])
            if st is not None:
                st.load_job = None
                st.answer = None  # pins are gone: a later lookup starts afresh
        elif job.failed and job.store_id:
            # every rank reported the copy finished or never started: the slots may go
            self._abort_store(job.namespace_id, job.store_id, job.epoch)

    def _abort_store(self, namespace_id: str, store_id: int, epoch: int) -> None:
        def abort() -> None:
            with contextlib.suppress(PoolUnavailable):
                self.client.abort_store(namespace_id, store_id, epoch=epoch, engine=self.engine)

        self._rpc.submit(abort)
