"""What the facade still owes vLLM after a hook raised and the pool was dropped (no torch).

A hook that raises leaves the connector disabled (`connector.py`), but vLLM may already count
on it: a request told it has N external tokens waits for them (async) or runs on them (layered),
and the workers may hold load and store jobs. Serving on is exact only if every such load is
reported failed, so vLLM recomputes those blocks, and every job the scheduler counts on is
reported done or failed, so its block references go back to vLLM.

- `PromisedLoads` (scheduler side): loads vLLM was promised that no metadata carried yet; after
  a fault they leave as jobs the workers fail (generation "": never a pool's), with the fence of
  copies already handed out.
- `WorkerDebts` (worker side): the jobs of a worker that dropped its pool, and of every metadata
  that reaches it afterwards, failed and reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvoffload_connector.common.metadata import ConnectorMeta, GroupTransfer, LoadJob, WorkerReport


@dataclass(frozen=True)
class OwedLoad:
    req_id: str
    groups: tuple[tuple[int, ...], ...]  # per KV group: the GPU block ids the load fills
    layered: bool  # the request runs in the step of its load (sync)


def _block_ids(blocks: Any, first: int, last: int) -> tuple[tuple[int, ...], ...]:
    """Per group, the ids of blocks [first, last) of vLLM's KVCacheBlocks (null blocks, below a
    sliding window, are skipped: nothing is loaded into them)."""
    per_group = getattr(blocks, "blocks", None)
    if per_group is None:
        return tuple(tuple(ids[first:last]) for ids in blocks.get_block_ids())
    return tuple(
        tuple(b.block_id for b in group[first:last] if not getattr(b, "is_null", False))
        for group in per_group
    )


class PromisedLoads:
    """Scheduler side: what `get_num_new_matched_tokens` promised, until metadata carries it."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._promised: dict[str, tuple[int, bool]] = {}  # req -> (computed tokens, async)
        self.owed: dict[str, OwedLoad] = {}
        self.fence: tuple[int, ...] = ()  # jobs out on the workers when the pool was dropped
        self._next_id = -1

    def promised(self, request: Any, num_computed: int, answer: Any) -> None:
        n, load_async = answer if isinstance(answer, tuple) else (0, False)
        if isinstance(n, int) and n > 0:
            self._promised[request.request_id] = (num_computed, bool(load_async))
        else:
            self._promised.pop(request.request_id, None)

    def allocated(self, request: Any, blocks: Any, num_external: int) -> None:
        """vLLM allocated the request's blocks: a load of `num_external` tokens is now owed."""
        promise = self._promised.pop(request.request_id, None)
        if promise is None or num_external <= 0:
            return
        computed, load_async = promise
        first = computed // self.block_size
        last = (computed + num_external) // self.block_size
        self.owed[request.request_id] = OwedLoad(
            request.request_id, _block_ids(blocks, first, last), not load_async
        )

    def shipped(self) -> None:
        """The pool's own metadata went out: it carried every load owed so far."""
        self.owed.clear()

    def forget(self, req_id: str) -> None:
        """The request finished: vLLM frees its blocks, nothing is loaded into them."""
        self._promised.pop(req_id, None)
        self.owed.pop(req_id, None)

    def pending(self) -> bool:
        return bool(self.owed or self.fence)

    def failing_meta(self) -> ConnectorMeta | None:
        """After a fault: the owed loads as jobs every worker fails (vLLM recomputes their
        blocks), and the fence; None when nothing is owed (once sent, nothing is)."""
        if not self.pending():
            return None
        loads = []
        for owed in self.owed.values():
            transfers = tuple(
                GroupTransfer(g, ids, (0,) * len(ids), (0,) * len(ids))
                for g, ids in enumerate(owed.groups)
                if ids
            )
            loads.append(LoadJob(self._next_id, owed.req_id, transfers, "", owed.layered))
            self._next_id -= 1
        meta = ConnectorMeta(loads=tuple(loads), fence=self.fence)
        self.owed, self.fence = {}, ()
        return meta


@dataclass
class WorkerDebts:
    """Worker side, after its pool was dropped: results and reports vLLM and the scheduler
    still wait for. Every load fails (recomputed), every store is reported failed."""

    reason: str = ""
    rank: int = 0
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    failed_blocks: set[int] = field(default_factory=set)  # of async loads (0.26 reports them)
    layered_blocks: set[int] = field(default_factory=set)
    done: dict[int, int] = field(default_factory=dict)
    failed: dict[int, int] = field(default_factory=dict)
    # jobs the worker already had when its pool went (their outcome is in done/failed): a
    # metadata object it was partly through fails only the rest, never one job twice
    known: set[int] = field(default_factory=set)
    _seen: Any = None

    def fail_load(self, job_id: int, req_id: str, blocks: Any, layered: bool) -> None:
        self.failed[job_id] = self.failed.get(job_id, 0) + 1
        if layered:
            self.layered_blocks.update(blocks)
        else:
            self.finished_recving.add(req_id)
            self.failed_recving.add(req_id)
            self.failed_blocks.update(blocks)

    def take_meta(self, md: Any) -> None:
        """Fail the jobs of a metadata object (each object once: hooks see it repeatedly)."""
        if md is None or md is self._seen:
            return
        self._seen = md
        for job in getattr(md, "loads", ()):
            if job.job_id not in self.known:
                blocks = [b for t in job.transfers for b in t.gpu_blocks]
                self.fail_load(job.job_id, job.req_id, blocks, job.layered)
        for job in getattr(md, "stores", ()):
            if job.job_id not in self.known:
                self.failed[job.job_id] = self.failed.get(job.job_id, 0) + 1

    def transfer_results(self) -> tuple[set[str], set[str], set[int], set[int]]:
        """(finished_recving, failed_recving, async failed blocks, layered failed blocks)."""
        out = (self.finished_recving, self.failed_recving, self.failed_blocks, self.layered_blocks)
        self.finished_recving, self.failed_recving = set(), set()
        self.failed_blocks, self.layered_blocks = set(), set()
        return out

    def report(self) -> WorkerReport | None:
        """Once the reason (the scheduler stops waiting for this rank), then job outcomes."""
        if not (self.reason or self.done or self.failed):
            return None
        ready = {self.rank: False} if self.reason else {}
        out = WorkerReport(done=self.done, failed=self.failed, ready=ready, no_pool=self.reason)
        self.reason, self.done, self.failed = "", {}, {}
        return out
