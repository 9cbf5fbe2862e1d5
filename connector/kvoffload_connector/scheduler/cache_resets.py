"""What vLLM takes back: preempted requests, GPU prefix-cache resets, connector resets (no torch).

A preempted request starts over (looked up and stored again on resume). Before vLLM resets its
GPU prefix cache, which it refuses while any block is in use, the scheduler gives back its block
references when they are all that stands in the way: copies already handed out are fenced (each
worker finishes them before its next forward), stores not handed out are dropped. A connector
reset (weight update) moves keys to a fresh epoch. Part of `OffloadScheduler` (scheduler.py).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from kvoffload_connector.scheduler.req_state import ReqState

# the scheduler side logs as one logger, whichever part of it speaks
log = logging.getLogger("kvoffload_connector.scheduler")


class CacheResets:
    """Preemptions and cache resets (a part of `OffloadScheduler`)."""

    def _restart(self, st: ReqState) -> None:
        """A preempted request's blocks are gone: look up and store again on resume."""
        st.stored_chunks = 0
        st.planned = False
        st.wait_from = -1
        st.waited_for_refresh = False  # waiting again: one more pass-over allowed
        if st.load_job is None and st.answer is not None:
            self._release(st.answer.pins)
            st.answer = None

    def _before_gpu_reset(self) -> None:
        """vLLM is about to reset its GPU prefix cache, which it refuses unless every block is
        free. With `reset_running_requests` it preempted the running requests just before,
        outside any step (no `preempted_req_ids` tell us): they start over. When our
        references are all that stands in the way, give them back (`_let_go`); while
        requests still hold blocks vLLM refuses anyway, and the stores keep theirs."""
        for st in self._reqs.values():
            if st.planned and not st.request.num_computed_tokens:
                self._restart(st)
                self._stores.undefer(st.req_id)  # its blocks' hashes are about to go
        pool = self.block_pool
        held: dict[int, list[Any]] = {}
        for b in self._referenced_blocks():
            held.setdefault(b.block_id, []).append(b)
        if not held:
            return
        ours_only = sum(1 for refs in held.values() if refs[0].ref_cnt == len(refs))
        in_use = pool.num_gpu_blocks - pool.get_num_free_blocks() - 1  # the null block is used
        if in_use == ours_only:
            self._let_go()

    def _referenced_blocks(self) -> list[Any]:
        """Every block reference this scheduler holds, one entry per reference."""
        blocks = [b for job in self._jobs.values() for b in job.blocks]
        blocks += self._stores.waiting_blocks()
        blocks += [b for planned in self._reserving.values() for p in planned for b in p.blocks]
        return blocks

    def _let_go(self) -> None:
        """Give vLLM back every block we reference. Copies already handed to the workers are
        fenced: each worker finishes them before its next forward, the first thing that can
        write into a freed block. Stores not handed out yet are dropped (a reservation in
        flight is aborted when it returns), since their blocks may be rewritten first."""
        self._gpu_resets += 1
        blocks = self._referenced_blocks()
        unsent = {s.job_id for s in self._stores_out}
        self._stores_out = []
        for job in list(self._jobs.values()):
            if job.job_id in unsent:
                del self._jobs[job.job_id]
                self._abort_store(job.namespace_id, job.store_id, job.epoch)
                self.stats.store_chunks_dropped += job.chunks
            else:
                self._fence.add(job.job_id)
            job.blocks = []
        self.stats.store_chunks_dropped += self._stores.drop_waiting()
        self._untouch(blocks)
        log.info(
            "kvoffload: vLLM resets its prefix cache: %d block references given back, %d "
            "copies finish before the next forward",
            len(blocks),
            len(self._fence),
        )

    def reset_cache(self) -> bool:
        """vLLM's `reset_connector` (after a weight update; `pause_generation` and `sleep`
        clear caches with it): what the pool holds may come from other weights. Keys move to
        a fresh random epoch (keys.in_epoch), so nothing stored before is found again by this
        engine; stale entries age out of the pool like any other, and KV events announce
        them removed at once (EventFeed.retire). Answers and pins taken
        before the reset are dropped; loads already running finish (vLLM preempted or aborted
        their requests)."""
        self._key_epoch = os.urandom(16)
        if self.event_feed is not None:
            self.event_feed.retire(os.urandom(8))  # the new epoch's name in announce blobs
        self.stats.cache_resets += 1
        for st in self._reqs.values():
            if st.queued:
                st.stale_lookup = True
            if st.answer is not None and st.load_job is None:
                self._release(st.answer.pins)
                st.answer = None
        log.info("kvoffload: vLLM reset the connector's cache: earlier pool entries are not used")
        return True
