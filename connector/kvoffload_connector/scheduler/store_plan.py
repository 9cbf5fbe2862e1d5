"""Store planning: which chunks of which requests go to the pool, and when (no torch).

Its own module so the scheduler (scheduler.py) only composes it: the scheduler references the
planned chunks' GPU blocks, reserves their slots and turns reservations into store jobs; this
module decides what to plan, and holds what waits to be planned or reserved.

- Eager mode plans every chunk that is full after this step (`plan_eager`). While half of the
  GPU cache is free, a request's plan waits until its first token has left the engine (the
  request's own blocks hold the bytes meanwhile): it is deferred, and planned once the token
  is out, when it finishes (`plan_finished`), when memory turns short, or from its blocks'
  hashes when it is preempted all the same.
- Lazy mode plans only chunks of finished requests (`remember_for_lazy`) whose GPU blocks
  reached the head of vLLM's free queue, next to be evicted (`plan_lazy`).
- With `store_after_first_token`, planned chunks of a request still waiting for its first
  token wait before their reservation (`hold_for_first_token`, `release_waiting`).
- The reuse gate (`store_threshold`, reuse.py) keeps chunks asked for too rarely out of eager
  plans.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvoffload_connector.common import compat
from kvoffload_connector.common.config import ConnectorConfig
from kvoffload_connector.common.keys import PoolKey, chunk_keys, in_epoch, make_key
from kvoffload_connector.scheduler.events import announce_blob
from kvoffload_connector.scheduler.first_token import FirstTokenWatch
from kvoffload_connector.scheduler.req_state import ReqState, cache_salt
from kvoffload_connector.scheduler.reuse import ReuseTracker

log = logging.getLogger(__name__)

# a store waits this many steps at most for its request's first token (a long chunked prefill)
STORE_WAIT_MAX_STEPS = 64


@dataclass
class PlannedChunk:
    req_id: str
    group: int
    chunk: int
    key: PoolKey
    blocks: list[Any]  # KVCacheBlocks of the chunk (already touched)
    announce: bytes = b""  # what KV events say of it once visible (events.py); b"": events off
    salt: str | None = None  # the request's vLLM cache_salt (the sidecar's per-tenant quotas)
    gpu_resets: int = 0  # vLLM prefix-cache resets before it was referenced (see _let_go)


@dataclass(frozen=True)
class LazyChunk:
    """Lazy mode: a finished request's chunk, stored once its GPU blocks near eviction, and
    the block hashes it had then (a block reused for other tokens no longer matches)."""

    chunk: PlannedChunk
    hashes: tuple[Any, ...]


@dataclass
class StorePlan:
    """The chunks a plan chose (their blocks not referenced yet: the scheduler touches them),
    and how many the reuse gate kept out (stats: `store_chunks_below_threshold`)."""

    chunks: list[PlannedChunk] = field(default_factory=list)
    below_threshold: int = 0


@dataclass(frozen=True)
class PlanContext:
    """What a plan reads of the scheduler's state, as it is at the hook that plans."""

    step: int  # build_connector_meta calls: engine steps
    key_epoch: bytes | None  # the cache epoch keys are named in (keys.in_epoch)
    events_epoch: bytes | None  # the KV event feed's epoch for announce blobs; None: events off


class StorePlanner:
    """Store planning for one scheduler. `reqs` is the scheduler's live request table (its
    entries' plan fields are written here: planned, stored_chunks, deferred_full, wait_from;
    the table itself is not), `first_token` its first-token watch, `reuse` its reuse gate;
    `window_start` (pool_lookup.py) says where a sliding-window group's kept chunks begin."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        *,
        block_size: int,
        num_groups: int,
        reqs: Mapping[str, ReqState],
        first_token: FirstTokenWatch,
        reuse: ReuseTracker,
        window_start: Callable[[int, int], int],
        max_num_batched_tokens: int = 8192,
    ):
        self.cfg = cfg
        self.block_size = block_size
        self.chunk_blocks = cfg.chunk_tokens // block_size
        self.chunk_tokens = cfg.chunk_tokens
        self.num_groups = num_groups
        self._reqs = reqs
        self._first_token = first_token
        self.reuse = reuse
        self.window_start = window_start
        self.block_pool: Any = None
        self.kv_cache_manager: Any = None
        # planned store chunks waiting for their request's first output token: (step, chunk)
        self._reserve_waiting: list[tuple[int, PlannedChunk]] = []
        # eager: requests whose store plan waits for their first token
        self._deferred: set[str] = set()
        # and their block ids when vLLM's KV cache manager serves them (gone once preempted)
        self._deferred_ids: dict[str, Sequence[Sequence[int]]] = {}
        self._step_blocks = -(-max_num_batched_tokens // block_size)  # one step's allocations
        self._tracked_blocks: dict[str, list[list[int]]] = {}  # vLLM 0.26 only
        self._lazy: dict[int, LazyChunk] = {}  # GPU block id -> the finished chunk it is in
        # requests whose last token this step computes, in an engine that may take no step
        # after it (in-process): nothing of theirs waits for a first token (set per step)
        self.ending: frozenset[str] = frozenset()
        watermark = cfg.lazy_watermark_blocks or 2 * num_groups * max(
            self.chunk_blocks, -(-max_num_batched_tokens // block_size)
        )
        self.lazy_watermark = watermark

    def bind(self, kv_cache_manager: Any, block_pool: Any) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.block_pool = block_pool

    def reuse_keys(self, request: Any, start: int = 0, end: int | None = None) -> list[PoolKey]:
        """Chunks [start, end) of a request as the reuse gate counts them: group 0's keys (a
        chunk's last block hash covers the prefix up to it, in every group)."""
        return chunk_keys(request.block_hashes, self.chunk_blocks, 0, end, start)

    # -- eager --------------------------------------------------------------------------
    def plan_eager(
        self, scheduler_output: Any, preempted: Sequence[str] | set[str], ctx: PlanContext
    ) -> StorePlan:
        """Every chunk that is full after this step, of each scheduled request. A request still
        waiting for its first token is only noted (`_defer`), and planned once the token is out,
        when it finishes, or when memory turns short; a deferred request preempted all the
        same is planned from its blocks' hashes (`_plan_preempted`)."""
        plan = StorePlan()
        defer_ok = None  # computed once, when a request could be deferred
        for req_id, n_sched in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            full = self._full_chunks(st, n_sched)
            if full <= st.stored_chunks:
                continue
            if self._may_defer(st, ctx.step):
                if defer_ok is None:
                    defer_ok = self._memory_allows_deferral()
                if defer_ok:
                    self._defer(st, full, ctx.step)
                    continue
            if req_id in self._deferred:
                self.undefer(req_id)
            self._plan_chunks(st, full, self._block_ids_of(req_id), plan, ctx)
        if self._deferred:
            for req_id in [r for r in preempted if r in self._deferred]:
                self._plan_preempted(req_id, plan, ctx)
            if defer_ok is False or (defer_ok is None and not self._memory_allows_deferral()):
                for req_id in list(self._deferred):  # running, not scheduled this step
                    st = self._reqs.get(req_id)
                    self.undefer(req_id)
                    if st is not None:
                        ids = self._block_ids_of(req_id)
                        self._plan_chunks(st, st.deferred_full, ids, plan, ctx)
        return plan

    def _full_chunks(self, st: ReqState, n_sched: int) -> int:
        """The request's chunks that are full once this step ran (its first schedule also
        skips what vLLM's GPU prefix cache gave it: an earlier request stored that)."""
        req = st.request
        if not st.planned:
            # First schedule: what vLLM found in its GPU prefix cache was computed by an
            # earlier request, whose eager stores sent it already (re-reserving it is a
            # round of PRESENT answers and block references held for nothing).
            st.planned = True
            gpu_chunks = req.num_computed_tokens // self.chunk_tokens
            if self.reuse.enabled:  # except what this request brought to the threshold
                gpu_chunks = self.reuse.first_unstored(self.reuse_keys(req, 0, gpu_chunks))
            st.stored_chunks = max(st.stored_chunks, gpu_chunks)
        computed = req.num_computed_tokens + n_sched
        if not self.cfg.store_decode:
            computed = min(computed, req.num_prompt_tokens)
        # only blocks vLLM publishes (EAGLE/MTP: their draft KV is written, compat)
        publishable = compat.publishable_block_hashes(req)
        return min(computed // self.chunk_tokens, publishable // self.chunk_blocks)

    # -- deferred planning: nothing on a request's path to its first token ---------------
    def _may_defer(self, st: ReqState, step: int) -> bool:
        """Stores wait for the first token (`store_after_first_token`), so their planning can
        wait too: under vLLM's async scheduling the prefill step and the one after it are
        scheduled before that token is sent, and the step after that while it is sent, so
        anything done there delays it. A long chunked prefill is planned after
        `STORE_WAIT_MAX_STEPS` steps all the same."""
        if not self.cfg.store_after_first_token or not self._first_token.awaits(st.req_id):
            return False
        if st.req_id in self.ending:
            return False
        return st.wait_from < 0 or step - st.wait_from < STORE_WAIT_MAX_STEPS

    def _memory_allows_deferral(self) -> bool:
        """A deferred request's blocks hold no reference of ours, and vLLM preempts only
        when an allocation fails: defer only while at least half of the GPU blocks are free
        and more than two steps' worth of allocations (token budget and one block per live
        request, per group), so a preemption before the next step's plan is not expected.
        If one happens all the same, `_plan_preempted` stores what is still intact."""
        pool = self.block_pool
        try:
            free, total = int(pool.get_num_free_blocks()), int(pool.num_gpu_blocks)
        except (AttributeError, TypeError, ValueError):
            return False  # a block pool without these counts: plan at once, as before
        margin = 2 * self.num_groups * (self._step_blocks + len(self._reqs) + 1)
        return free >= max(margin, total // 2)

    def _defer(self, st: ReqState, full: int, step: int) -> None:
        self._deferred.add(st.req_id)
        if st.wait_from < 0:
            st.wait_from = step
        st.deferred_full = full
        if self.kv_cache_manager is not None:  # vLLM 0.26's tracked ids outlive a preemption
            with contextlib.suppress(KeyError):
                self._deferred_ids[st.req_id] = self.kv_cache_manager.get_block_ids(st.req_id)

    def undefer(self, req_id: str) -> None:
        """The request's plan no longer waits (planned now, or its blocks' hashes are gone)."""
        self._deferred.discard(req_id)
        self._deferred_ids.pop(req_id, None)

    def _plan_preempted(self, req_id: str, plan: StorePlan, ctx: PlanContext) -> None:
        """A deferred request was preempted: vLLM dropped its reference to its blocks (and
        reset its computed tokens), so only blocks that still carry the hash of the chunk they
        held are planned (a block handed to another request loses or changes its hash; with
        vLLM 0.26's fenced frees none is handed on yet). The rest is recomputed on resume."""
        self._deferred.discard(req_id)
        st = self._reqs.get(req_id)
        block_ids = self._block_ids_of(req_id, preempted=True)
        if st is None or block_ids is None:
            return
        self._plan_chunks(st, st.deferred_full, block_ids, plan, ctx, verify=True)

    def plan_finished(
        self, req_id: str, block_ids: Sequence[Sequence[int]], ctx: PlanContext
    ) -> StorePlan:
        """A request finished. A deferred one (finished before its first token was out: one
        output token, an abort): vLLM frees its blocks after this hook, so they are planned now,
        for the scheduler to reference and reserve at once. Anything else: nothing to plan."""
        plan = StorePlan()
        if req_id not in self._deferred:
            return plan
        self.undefer(req_id)
        st = self._reqs.get(req_id)
        if st is None or self.block_pool is None:
            return plan
        ids = self._block_ids_of(req_id)
        self._plan_chunks(st, st.deferred_full, ids if ids else block_ids, plan, ctx)
        return plan

    def _plan_chunks(
        self,
        st: ReqState,
        full: int,
        block_ids: Sequence[Sequence[int]] | None,
        plan: StorePlan,
        ctx: PlanContext,
        verify: bool = False,
    ) -> None:
        """Plan chunks [stored_chunks, full) of a request from its GPU block ids. `verify`:
        the blocks are no longer the request's, keep only chunks whose blocks still hold it."""
        if full <= st.stored_chunks or block_ids is None:
            return
        req, pool = st.request, self.block_pool
        storable = full
        if self.reuse.enabled:
            new = self.reuse_keys(req, st.stored_chunks, full)
            storable = st.stored_chunks + self.reuse.storable(new, st.store_gated)
            plan.below_threshold += full - storable
            self.reuse.mark_stored(new[: storable - st.stored_chunks])
        hashes = req.block_hashes
        # sliding-window groups keep only what a hit at the prompt's end (or later) reads
        prompt_hit = (req.num_prompt_tokens - 1) // self.block_size * self.block_size
        keep_from = [
            self.window_start(g, prompt_hit // self.chunk_tokens) for g in range(self.num_groups)
        ]
        for c in range(st.stored_chunks, storable):
            for g in range(min(self.num_groups, len(block_ids))):
                if c < keep_from[g]:
                    continue
                ids = block_ids[g][c * self.chunk_blocks : (c + 1) * self.chunk_blocks]
                if len(ids) < self.chunk_blocks:
                    continue
                blocks = [pool.blocks[i] for i in ids]
                if any(b.is_null for b in blocks):
                    continue
                first = c * self.chunk_blocks
                if verify and not all(
                    b.block_hash is not None
                    and bytes(b.block_hash) == make_key(hashes[first + i], g)
                    for i, b in enumerate(blocks)
                ):
                    continue
                (key,) = in_epoch(
                    [make_key(hashes[first + self.chunk_blocks - 1], g)], ctx.key_epoch
                )
                announce = self._announce(req, g, c, ctx.events_epoch)
                plan.chunks.append(
                    PlannedChunk(st.req_id, g, c, key, blocks, announce, cache_salt(req))
                )
        st.stored_chunks = full

    # -- the requests' GPU block ids ----------------------------------------------------
    def _block_ids_of(self, req_id: str, preempted: bool = False) -> Sequence[Sequence[int]] | None:
        """The request's GPU block ids per group. `preempted`: vLLM already took them from
        the request; the ones noted when it was deferred (`_deferred_ids`) serve instead."""
        if preempted and req_id in self._deferred_ids:
            return self._deferred_ids.pop(req_id)
        if self.kv_cache_manager is not None:
            with contextlib.suppress(KeyError):
                return self.kv_cache_manager.get_block_ids(req_id)
            return None
        return self._tracked_blocks.get(req_id)

    def track_block_ids(self, scheduler_output: Any) -> None:
        """vLLM 0.26 (no kv_cache_manager binding): follow block tables from the output."""
        for r in getattr(scheduler_output, "scheduled_new_reqs", ()):
            self._tracked_blocks[r.req_id] = [list(g) for g in r.block_ids]
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is None:
            return
        resumed = getattr(cached, "resumed_req_ids", set())
        for req_id, new in zip(cached.req_ids, cached.new_block_ids, strict=False):
            if new is None:
                continue
            if req_id in resumed or req_id not in self._tracked_blocks:
                self._tracked_blocks[req_id] = [list(g) for g in new]
            else:
                for g, ids in zip(self._tracked_blocks[req_id], new, strict=False):
                    g.extend(ids)

    def forget(self, req_id: str) -> None:
        """The request finished: its tracked block table goes (vLLM 0.26)."""
        self._tracked_blocks.pop(req_id, None)

    # -- lazy ---------------------------------------------------------------------------
    def remember_for_lazy(
        self, request: Any, block_ids: Sequence[Sequence[int]], ctx: PlanContext
    ) -> None:
        """Lazy mode: note the finished request's full chunks, stored when near eviction."""
        st = self._reqs.get(request.request_id)
        start = st.stored_chunks if st is not None else 0
        n_full = compat.publishable_block_hashes(request) // self.chunk_blocks
        pool = self.block_pool
        for g in range(min(self.num_groups, len(block_ids))):
            for c in range(start, n_full):
                ids = block_ids[g][c * self.chunk_blocks : (c + 1) * self.chunk_blocks]
                if len(ids) < self.chunk_blocks:
                    break
                blocks = tuple(pool.blocks[i] for i in ids)
                if any(b.is_null or b.block_hash is None for b in blocks):
                    continue
                (key,) = in_epoch(
                    [make_key(request.block_hashes[(c + 1) * self.chunk_blocks - 1], g)],
                    ctx.key_epoch,
                )
                chunk = PlannedChunk(
                    request.request_id,
                    g,
                    c,
                    key,
                    list(blocks),
                    self._announce(request, g, c, ctx.events_epoch),
                    cache_salt(request),
                )
                entry = LazyChunk(chunk, tuple(b.block_hash for b in blocks))
                for b in blocks:
                    self._lazy[b.block_id] = entry

    def plan_lazy(self) -> StorePlan:
        plan = StorePlan()
        if not self._lazy:
            return plan
        seen: set[bytes] = set()
        queue = self.block_pool.free_block_queue
        blk = queue.fake_free_list_head.next_free_block
        tail = queue.fake_free_list_tail
        for _ in range(self.lazy_watermark):
            if blk is None or blk is tail:
                break
            entry = self._lazy.get(blk.block_id)
            blk = blk.next_free_block
            if entry is None:
                continue
            chunk = entry.chunk
            for b in chunk.blocks:
                self._lazy.pop(b.block_id, None)
            if chunk.key in seen or any(
                b.block_hash != h for b, h in zip(chunk.blocks, entry.hashes, strict=True)
            ):
                continue  # already planned, or a block was reused for other tokens
            seen.add(chunk.key)
            plan.chunks.append(chunk)
        return plan

    def _announce(self, request: Any, group: int, chunk: int, events_epoch: bytes | None) -> bytes:
        """The chunk's announce blob when KV events are on (b"" when off or it cannot be made:
        an event detail never stops a store)."""
        if events_epoch is None:
            return b""
        try:
            return announce_blob(
                request,
                group,
                chunk * self.chunk_blocks,
                self.chunk_blocks,
                self.block_size,
                events_epoch,  # names the key epoch in the blob (not the key)
            )
        except Exception:  # noqa: BLE001
            log.debug("kvoffload: no announce blob for a chunk", exc_info=True)
            return b""

    # -- planned chunks waiting for their request's first token --------------------------
    def hold_for_first_token(self, planned: list[PlannedChunk], step: int) -> list[PlannedChunk]:
        """The planned chunks to reserve now: with `store_after_first_token`, those of requests
        still waiting for their first token wait (`release_waiting`)."""
        if self.cfg.store_after_first_token:
            waits = {
                r: self._first_token.awaits(r) and r not in self.ending
                for r in {p.req_id for p in planned}
            }
            if any(waits.values()):  # the wait counts from the request's first deferral
                self._reserve_waiting.extend(
                    (self._wait_from(p.req_id, step), p) for p in planned if waits[p.req_id]
                )
                planned = [p for p in planned if not waits[p.req_id]]
        return planned

    def _wait_from(self, req_id: str, step: int) -> int:
        st = self._reqs.get(req_id)
        return st.wait_from if st is not None and st.wait_from >= 0 else step

    def release_waiting(self, preempted: set[str], step: int) -> list[PlannedChunk]:
        """The waiting chunks to reserve now: their requests have their first token, were
        preempted (memory is short: their blocks should free as soon as they are stored) or
        waited too long."""
        still: list[tuple[int, PlannedChunk]] = []
        ready: list[PlannedChunk] = []
        waits: dict[str, bool] = {}
        for made, p in self._reserve_waiting:
            if p.req_id not in waits:
                waits[p.req_id] = p.req_id not in preempted and self._first_token.awaits(p.req_id)
            if waits[p.req_id] and step - made < STORE_WAIT_MAX_STEPS:
                still.append((made, p))
            else:
                ready.append(p)
        self._reserve_waiting = still
        return ready

    def has_waiting(self) -> bool:
        return bool(self._reserve_waiting)

    def waiting_blocks(self) -> list[Any]:
        """The blocks of the waiting chunks, one entry per reference the scheduler holds."""
        return [b for _, p in self._reserve_waiting for b in p.blocks]

    def drop_waiting(self) -> int:
        """vLLM takes the blocks back (`_let_go`): the waiting chunks go; how many went."""
        dropped = len(self._reserve_waiting)
        self._reserve_waiting = []
        return dropped
