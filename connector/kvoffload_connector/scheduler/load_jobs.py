"""Load jobs: a request's pinned pool hit turned into copies into its GPU blocks (no torch).

After vLLM allocated the request's blocks (`update_state_after_alloc`) the blocks to fill get a
reference and the pinned slots (with the versions the workers check after the copy) become one
`LoadJob` for the workers. An answer whose registration ended meanwhile makes a job the workers
fail, so vLLM recomputes. Part of `OffloadScheduler` (scheduler.py).
"""

from __future__ import annotations

import logging
from typing import Any

from kvoffload_connector.common.metadata import GroupTransfer, LoadJob
from kvoffload_connector.scheduler.job_table import Job

# the scheduler side logs as one logger, whichever part of it speaks
log = logging.getLogger("kvoffload_connector.scheduler")


class LoadJobs:
    """Building load jobs (a part of `OffloadScheduler`)."""

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._schedulable.pop(request.request_id, None)  # admitted
        st = self._reqs.get(request.request_id)
        if st is None or st.answer is None:
            return
        answer = st.answer
        if num_external_tokens <= 0 or not answer.pins or st.load_job is not None:
            return
        start_tok = st.hit_end - num_external_tokens
        first, last = start_tok // self.block_size, st.hit_end // self.block_size
        per_group = blocks.blocks
        transfers, held, versions = [], [], []
        generation = answer.generation
        if not self._answer_alive(answer):
            log.info("kvoffload: the lookup's registration ended before its load: load fails")
            generation = ""  # its pins are gone: the workers fail the job, vLLM recomputes
        for g in range(self.num_groups):
            gpu, slots, idx, ver = [], [], [], []
            group_blocks = per_group[g]
            for b in range(first, min(last, len(group_blocks))):
                blk = group_blocks[b]
                if blk.is_null:  # sliding-window blocks below the window: nothing to load
                    continue
                slot = answer.slots[g][b // self.chunk_blocks]
                if slot is None:  # vLLM kept a block the window rule said it would drop
                    log.warning("kvoffload: no slot for block %d of group %d: load fails", b, g)
                    generation = ""  # the workers fail the job: vLLM recomputes (never garbage)
                    continue
                gpu.append(blk.block_id)
                slots.append(slot)
                idx.append(b % self.chunk_blocks)
                chunk = b // self.chunk_blocks
                group_versions = answer.versions[g] if g < len(answer.versions) else ()
                ver.append(group_versions[chunk] if chunk < len(group_versions) else 0)
                held.append(blk)
            if gpu:
                transfers.append(GroupTransfer(g, tuple(gpu), tuple(slots), tuple(idx)))
                versions.append(tuple(ver))
        job_id = next(self._job_ids)
        self._touch(held)
        self._jobs[job_id] = Job(job_id, "load", (st.req_id,), held, pins=answer.pins)
        st.load_job = job_id
        st.stored_chunks = max(st.stored_chunks, answer.hit_chunks)
        self.stats.hit_tokens += num_external_tokens
        layered = not st.load_async
        self._loads_out.append(
            LoadJob(job_id, st.req_id, tuple(transfers), generation, layered, tuple(versions))
        )
