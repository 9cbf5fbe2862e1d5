"""Store jobs: planned chunks reserved in the pool and handed to the workers (no torch).

What to store and when is `store_plan.py`'s. Here a plan's GPU blocks get a reference, its
chunks' slots are reserved in one batched `ReserveStore` (on the RPC thread; inline in the
planning step of an engine that dispatches inline), and the chunks answered NEW become one
`StoreJob` in the connector metadata; the rest lose their reference at once. A reservation
with a slot past a rank's registered pieces (pool_readiness.py, `_slot_limit`) is aborted
before any copy. KV events ride along: each chunk's announce blob goes with its reservation.
Part of `OffloadScheduler`.
"""

from __future__ import annotations

import logging
from typing import Any

from kvoffload_connector.common.client import PoolUnavailable
from kvoffload_connector.common.metadata import GroupTransfer, StoreJob
from kvoffload_connector.scheduler.job_table import Job
from kvoffload_connector.scheduler.store_plan import PlanContext, PlannedChunk, StorePlan

# the scheduler side logs as one logger, whichever part of it speaks
log = logging.getLogger("kvoffload_connector.scheduler")


STORE_NEW = 1  # pool_pb2.STORE_DECISION_NEW (kept numeric: no proto import on this path)


class StoreJobs:
    """Reserving stores and building store jobs (a part of `OffloadScheduler`)."""

    def _plan_context(self) -> PlanContext:
        """What a store plan reads of this scheduler now: the step, the key and event epochs."""
        feed = self.event_feed
        return PlanContext(self._step, self._key_epoch, feed.epoch if feed is not None else None)

    def _reserve(self, plan: StorePlan, inline: bool = False) -> None:
        """Reference the plan's blocks, then reserve its chunks (store_plan.py holds back those
        waiting for their request's first token); `inline`: see `_send_reservation`."""
        self.stats.store_chunks_below_threshold += plan.below_threshold
        planned = plan.chunks
        if not planned:
            return
        for p in planned:
            self._touch(p.blocks)
            p.gpu_resets = self._gpu_resets
        self.stats.store_chunks_planned += len(planned)
        self._send_reservation(self._stores.hold_for_first_token(planned, self._step), inline)

    def _send_reservation(self, planned: list[PlannedChunk], inline: bool = False) -> None:
        """Reserve slots for `planned` (blocks already held) in the background; `inline`
        (the step's planning hook of an engine that dispatches inline): now, deadline-bound,
        so the store jobs go out in this step's metadata."""
        if not planned:
            return
        if not self._usable():
            self._rpc.submit(self.client.ensure)  # reconnect in the background, drop these
            self._tell_unusable()
            self._on_reserved(planned, None, "", "", 0)
            return
        self._told_unusable = ""
        self._reservations_in_flight += 1
        self._reserving[id(planned)] = planned
        if inline and self._dispatch_inline:
            self._reserve_rpc(planned)
            self._drain()  # the answer becomes this step's store jobs
            return
        self._rpc.submit(lambda: self._reserve_rpc(planned))

    def _reserve_rpc(self, planned: list[PlannedChunk]) -> None:
        try:
            reg = self.client.registration
            announce = [p.announce for p in planned] if self.event_feed is not None else ()
            salts = [p.salt for p in planned]  # per key: the sidecar's per-tenant quotas
            res = self.client.reserve_store([p.key for p in planned], announce, salts)
            payload = (
                planned,
                res,
                reg.namespace_id if reg else "",
                reg.generation if reg else "",
                getattr(reg, "epoch", 0),
            )
        except PoolUnavailable:
            payload = (planned, None, "", "", 0)
        self._results.append(("store", payload))

    def _on_reserved(
        self,
        planned: list[PlannedChunk],
        res: Any,
        namespace_id: str,
        generation: str,
        epoch: int = 0,
    ) -> None:
        """Scheduler thread: turn a reservation into a store job; drop what is not NEW."""
        self._reserving.pop(id(planned), None)
        if planned and planned[0].gpu_resets != self._gpu_resets:
            # vLLM reset its prefix cache meanwhile and has these blocks back (`_let_go`)
            self.stats.store_chunks_dropped += len(planned)
            if res is not None and STORE_NEW in res.decisions:
                self._abort_store(namespace_id, res.store_id, epoch)
            return
        drop: list[Any] = []
        keep: list[tuple[PlannedChunk, int]] = []
        if res is None:
            drop = [b for p in planned for b in p.blocks]
            self.stats.store_chunks_dropped += len(planned)
        else:
            slot_iter = iter(res.slots)
            for p, decision in zip(planned, res.decisions, strict=True):
                if decision == STORE_NEW:
                    keep.append((p, next(slot_iter)))
                else:
                    drop.extend(p.blocks)
        limit = self._slot_limit()
        if keep and limit is not None and any(slot >= limit for _, slot in keep):
            # a slot past a rank's registered pieces: no copy may touch it, so the whole
            # reservation is aborted (its slots freed, nothing committed) and its chunks are
            # not stored, as a dropped store; a rank registers ~10 GiB a second, so this lasts
            # only while a rank attaches
            self.unregistered_store_chunks += len(keep)
            self.stats.store_chunks_dropped += len(keep)
            drop.extend(b for p, _ in keep for b in p.blocks)
            keep = []
            self._abort_store(namespace_id, res.store_id, epoch)
        self._untouch(drop)
        if not keep:
            return
        by_group: dict[int, tuple[list[int], list[int], list[int]]] = {}
        held: list[Any] = []
        for p, slot in keep:
            gpu, slots, idx = by_group.setdefault(p.group, ([], [], []))
            for i, b in enumerate(p.blocks):
                gpu.append(b.block_id)
                slots.append(slot)
                idx.append(i)
            held.extend(p.blocks)
        transfers = tuple(
            GroupTransfer(g, tuple(a), tuple(s), tuple(i))
            for g, (a, s, i) in sorted(by_group.items())
        )
        job_id = next(self._job_ids)
        req_ids = tuple(sorted({p.req_id for p, _ in keep}))
        self._jobs[job_id] = Job(
            job_id,
            "store",
            req_ids,
            held,
            store_id=res.store_id,
            namespace_id=namespace_id,
            epoch=epoch,
            chunks=len(keep),
        )
        self._stores_out.append(
            StoreJob(job_id, res.store_id, namespace_id, transfers, generation, epoch, self.engine)
        )

    def take_events(self) -> list[Any]:
        """vLLM's `take_events`: the host tier's BlockStored/BlockRemoved since the last step."""
        return self.event_feed.take() if self.event_feed is not None else []

    def publish_events_through(self, publisher: Any) -> bool:
        """Announce the host tier through vLLM's own publisher from the feed's poll thread, so
        no engine step is needed (events.py); False: `take_events` stays the path."""
        return self.event_feed is not None and self.event_feed.publish_through(publisher)
