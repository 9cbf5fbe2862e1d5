"""Scheduler side of the connector: vLLM's scheduler hooks, composed of parts (no torch).

Runs in vLLM's EngineCore process on the scheduler thread. Network calls go to
one `RpcThread` (all but the inline lookups and inline reservations, bounded by
their deadlines), and their answers come back through a deque that the scheduler
drains at its next hook. `OffloadScheduler` owns the state and the per-step hooks
(`build_connector_meta`, `update_connector_output`, `request_finished`); each part
is its own module:

- `lookup_answers.py`: when a request asks the pool, and what vLLM is told
  (inline or batched lookups, presence-map misses, refreshes; the n-1 rule).
- `load_jobs.py`: a pinned hit turned into a `LoadJob` once vLLM allocated the blocks.
- `store_jobs.py`: plans (`store_plan.py`: eager, every chunk full after this step;
  lazy, chunks whose blocks near eviction) referenced, reserved and turned into
  `StoreJob`s. The job goes to the workers in the step after the reservation
  answered, or, in an engine that may take no step after this one (in-process:
  `LLM.generate` stops with its last request), in the step that planned it: the
  reservation runs inline there, and a request whose last token that step samples
  waits for no first token.
- `job_table.py`: every job holds a reference on its GPU blocks until all ranks
  reported it, so no block is reused before its copy finished.
- `cache_resets.py`: preemptions, GPU prefix-cache resets, connector resets.
- `pool_readiness.py`: registration (at engine start, from the workers' handshake
  metadata) and whether the pool may be used now.
- `scheduler_stats.py`: the counters for vLLM's stats.
"""

from __future__ import annotations

import collections
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvoffload_connector.common.client import PoolClient, RpcThread
from kvoffload_connector.common.config import ConnectorConfig, StoreMode
from kvoffload_connector.common.engine_key import MAX_ENGINE
from kvoffload_connector.common.metadata import (
    ConnectorMeta,
    LoadJob,
    Registration,
    StoreJob,
    WorkerReport,
)
from kvoffload_connector.scheduler.cache_resets import CacheResets
from kvoffload_connector.scheduler.events import EventFeed
from kvoffload_connector.scheduler.first_token import FirstTokenWatch
from kvoffload_connector.scheduler.job_table import Job, JobTable
from kvoffload_connector.scheduler.load_jobs import LoadJobs
from kvoffload_connector.scheduler.lookup_answers import LookupAnswer, LookupAnswers
from kvoffload_connector.scheduler.pool_lookup import PoolLookup
from kvoffload_connector.scheduler.pool_readiness import PoolReadiness
from kvoffload_connector.scheduler.req_state import ReqState
from kvoffload_connector.scheduler.reset_guard import install_reset_guard
from kvoffload_connector.scheduler.reuse import ReuseTracker
from kvoffload_connector.scheduler.scheduler_stats import SchedulerStats, StatsReporting, as_dict
from kvoffload_connector.scheduler.store_jobs import STORE_NEW, StoreJobs
from kvoffload_connector.scheduler.store_plan import PlannedChunk, StorePlanner

__all__ = ["STORE_NEW", "Job", "OffloadScheduler", "SchedulerStats", "as_dict"]

log = logging.getLogger(__name__)


class OffloadScheduler(
    LookupAnswers, LoadJobs, StoreJobs, JobTable, CacheResets, PoolReadiness, StatsReporting
):
    """The connector's scheduler half: its state, and vLLM's per-step hooks."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        *,
        block_size: int,
        num_groups: int,
        world_size: int,
        client: PoolClient,
        max_num_batched_tokens: int = 8192,
        windows: Sequence[int] | None = None,
        clock=time.monotonic,
        kv_events: bool = False,
        yield_gil: Callable[[], None] = lambda: time.sleep(0),
        engine: int = 0,
        dispatch_inline: bool = False,
    ):
        # An engine that may take no step after this one (in-process: `LLM.generate` stops
        # with its last request) reserves a step's stores inline, so their jobs ride that
        # step's metadata; a request whose last token this step computes waits for no first
        # token (no later step to wait in; `_ending`).
        self._dispatch_inline = dispatch_inline
        self.cfg = cfg
        self.block_size = block_size
        self.chunk_blocks = cfg.chunk_tokens // block_size
        self.chunk_tokens = cfg.chunk_tokens
        self.num_groups = num_groups
        # per group: sliding window in tokens, 0 for full attention (hybrid models)
        self.windows = list(windows or []) + [0] * (num_groups - len(windows or []))
        self.sliding = [g for g in range(num_groups) if self.windows[g] > 0]
        self.world_size = world_size
        self.client = client
        # This engine's key: its store reservations belong to it (not to a session), and its
        # workers hold their ranks' locks for it (engine_lock.py); fresh per engine start
        # (`engine_key.engine_key`: its workers derive the same one and lock from start).
        self.engine = engine or secrets.randbelow(MAX_ENGINE - 1) + 1
        client.engine = self.engine
        self._lookup = PoolLookup(client, self.windows, cfg.chunk_tokens)
        self._clock = clock
        self._yield_gil = yield_gil  # first_token_handoff: a GIL release (sleep(0))
        self._rpc = RpcThread("kvoffload-scheduler-rpc")
        self._results: collections.deque = collections.deque()  # (kind, payload) from _rpc
        self._answered = threading.Event()  # set by _rpc after each lookup answer
        self._reqs: dict[str, ReqState] = {}
        self._lookup_queue: list[ReqState] = []
        self._refreshes_in_flight = 0
        self.refreshed_hits = 0  # refreshes that found a longer hit (tests, debugging)
        self._loads_out: list[LoadJob] = []
        self._stores_out: list[StoreJob] = []
        self._jobs: dict[int, Job] = {}
        self._job_ids = itertools.count(1)
        # store reservations in flight on the RPC thread (their chunks hold block references)
        self._reserving: dict[int, list[PlannedChunk]] = {}
        # vLLM prefix-cache resets that took our block references back (`_let_go`), and the
        # jobs whose copies the workers must finish before the next forward (`fence`)
        self._gpu_resets = 0
        self._fence: set[int] = set()
        # the cache epoch keys are named in (keys.in_epoch): None until vLLM resets our cache
        self._key_epoch: bytes | None = None
        self._reservations_in_flight = 0
        self._lookups_in_flight = 0
        self._inline_spent_s = 0.0  # inline lookups' time in the current step
        self._step = 0  # build_connector_meta calls: engine steps
        # requests answered (schedulable) and not yet admitted: req id -> step of the answer
        self._schedulable: dict[str, int] = {}
        # requests the presence map answered, for `_count_presence_misses`: their salt, block
        # hashes, usable chunks and key epoch (keys are built on the RPC thread, off the step)
        self._presence_missed: list[tuple[str | None, Sequence[bytes], int, bytes | None]] = []
        self._missed_reported_at = float("-inf")  # the first misses are due at once
        self._oldest_miss_at = 0.0  # when the first miss not yet reported was counted
        self._first_token = FirstTokenWatch(self._output_count)
        self._stats_taken_at = float("-inf")
        self._pool_sent_for: Any = None  # the registration whose pool_entry the stats carried
        self._pool_sent_at = float("-inf")
        self._lookup_ewma_s = 0.0  # recent lookup round trips (inline and background)
        self._registration: Registration | None = None
        self._no_pool = (
            ""  # a worker's reason for having no pool (stops the first-registration wait)
        )
        self._ready: dict[int, bool] = {}  # rank -> pool ready (empty: not reported yet)
        # rank -> slots [0, n) of its region registered with its device so far (ready: all)
        self._usable_end: dict[int, int] = {}
        self.unregistered_hit_chunks = 0  # hit chunks past a rank's registered end: misses
        self.unregistered_store_chunks = 0  # reserved past it: aborted, never copied
        self._unready_since: float | None = None  # a rank's pool became not ready then
        self._first_query_at: float | None = None
        self._told_unusable = ""  # the reason last logged for serving without the pool
        self.block_pool: Any = None
        self.kv_cache_manager: Any = None
        self.stats = SchedulerStats()
        # the gate is eager mode's (lazy stores only what leaves the GPU): lazy counts nothing
        self.reuse = ReuseTracker(cfg.store_threshold if cfg.mode is StoreMode.EAGER else 0)
        self._gate_said = False  # store_threshold auto closed its gate once, said at INFO
        # what to store and when (store_plan.py); this scheduler references and reserves it
        self._stores = StorePlanner(
            cfg,
            block_size=block_size,
            num_groups=num_groups,
            reqs=self._reqs,
            first_token=self._first_token,
            reuse=self.reuse,
            window_start=self._lookup.window_start,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        # KV events (--kv-events-config): the chunks' announce blobs go with their reservation,
        # and a feed follows the pool's event log (events.py)
        self.event_feed: EventFeed | None = None
        if kv_events:
            self.event_feed = EventFeed(
                lambda *a: self.client.events(*a), interval_s=cfg.events_interval_ms / 1e3
            )
            self.event_feed.start()

    def bind(self, kv_cache_manager: Any = None, block_pool: Any = None) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.block_pool = (
            block_pool if block_pool is not None else getattr(kv_cache_manager, "block_pool", None)
        )
        self._stores.bind(self.kv_cache_manager, self.block_pool)
        if self.block_pool is not None:
            install_reset_guard(self.block_pool, self._before_gpu_reset)

    def _drain(self) -> None:
        while self._results:
            kind, payload = self._results.popleft()
            if kind == "lookup":
                self._lookups_in_flight -= 1
                for req_id, answer in payload:
                    st = self._reqs.get(req_id)
                    if st is None or not st.queued or st.stale_lookup:
                        # finished meanwhile, or asked before a cache reset: pins go back
                        if answer is not None and answer.pins:
                            self._release(answer.pins)
                        if st is not None and st.stale_lookup:
                            st.queued = st.stale_lookup = False  # asked again when next seen
                        continue
                    st.queued = False
                    st.answer = answer if answer is not None else LookupAnswer(0, [], [], "")
                    st.answer_step = self._step
            elif kind == "refresh":
                self._refreshes_in_flight -= 1
                for req_id, answer in payload:
                    self._adopt_refresh(self._reqs.get(req_id), answer)
            elif kind == "store":
                self._reservations_in_flight -= 1
                self._on_reserved(*payload)
            elif kind == "lookup_seconds":
                self.stats.lookups += 1
                self.stats.lookup_seconds += payload
                self._lookup_ewma_s += 0.25 * (payload - self._lookup_ewma_s)

    def _output_count(self, req_id: str) -> int | None:
        """A live request's output-token count (None once finished or aborted)."""
        st = self._reqs.get(req_id)
        return getattr(st.request, "num_output_tokens", None) if st is not None else None

    def build_connector_meta(self, scheduler_output: Any) -> ConnectorMeta:
        if self.cfg.first_token_handoff and self._first_token.newly_out():
            # The first hook after vLLM queued an output with a request's first token: its
            # output thread waits for the GIL, which this thread would hold until it blocks
            # after launching the step being scheduled. Released here, the token goes out now.
            self._yield_gil()
        if (
            (self._lookups_in_flight or self._refreshes_in_flight)
            and not self._results
            and not getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        ):
            # Nothing was scheduled because requests wait for their lookups: wait for the
            # answer here (bounded) instead of letting the engine loop spin empty steps that
            # starve the RPC thread of the GIL. No scheduled work is delayed by this.
            self._answered.wait(min(self.cfg.lookup_timeout_ms, 50) / 1e3)
        if self._answered.is_set():  # (clear() takes the event's lock every step)
            self._answered.clear()
        self._inline_spent_s = 0.0  # the next scheduling call is a new step
        self._step += 1
        if self._schedulable:
            for req_id in getattr(scheduler_output, "num_scheduled_tokens", None) or ():
                self._schedulable.pop(req_id, None)
        if self._results:
            self._drain()
        if self.kv_cache_manager is None:
            self._stores.track_block_ids(scheduler_output)
        preempted = getattr(scheduler_output, "preempted_req_ids", None)
        if self._dispatch_inline:
            self._stores.ending = self._ending(scheduler_output)
        if self.block_pool is not None:
            if self.cfg.mode is StoreMode.EAGER:
                ctx = self._plan_context()
                plan = self._stores.plan_eager(scheduler_output, preempted or (), ctx)
                self._reserve(plan, inline=True)
            else:
                self._reserve(self._stores.plan_lazy(), inline=True)
        if self._stores.has_waiting():
            # a preempted request's blocks are wanted back: its stores leave now, not later
            ready = self._stores.release_waiting(set(preempted or ()), self._step)
            self._send_reservation(ready, inline=True)
        self._send_lookups()
        self._count_presence_misses()
        # A preempted request's blocks with stores in flight stay referenced until stored, so
        # nothing waits here (vLLM's own connectors block the step on those stores instead).
        for req_id in preempted or ():
            st = self._reqs.get(req_id)
            if st is not None:
                self._restart(st)
        # the worker reads longest_query only in a step that loads (a pass over the batch)
        scheduled = (
            getattr(scheduler_output, "num_scheduled_tokens", None) if self._loads_out else None
        )
        meta = ConnectorMeta(
            loads=tuple(self._loads_out),
            stores=tuple(self._stores_out),
            longest_query=max(scheduled.values(), default=0) if scheduled else 0,
            fence=tuple(sorted(self._fence)),
            engine=self.engine,
        )
        self._loads_out, self._stores_out = [], []
        self._fence.clear()
        return meta

    def _ending(self, scheduler_output: Any) -> frozenset[str]:
        """The scheduled requests whose last output token this step samples: their whole
        prompt is computed after it and `max_tokens` is reached (tokens of steps in flight
        under async scheduling counted). One that stops earlier (EOS, a stop string) is
        planned when it finishes, for the next step to carry."""
        ending = []
        for req_id, n in (getattr(scheduler_output, "num_scheduled_tokens", None) or {}).items():
            st = self._reqs.get(req_id)
            req = st.request if st is not None else None
            max_tokens = getattr(req, "max_tokens", None)
            if max_tokens is None or req.num_computed_tokens + n < req.num_prompt_tokens:
                continue
            out = getattr(req, "num_output_tokens", 0) + getattr(req, "num_output_placeholders", 0)
            if out + 1 >= max_tokens:
                ending.append(req_id)
        return frozenset(ending)

    def update_connector_output(self, report: WorkerReport | None) -> None:
        if report is None:
            return
        if report.ready or report.usable:
            self._note_ranks(report.ready, report.usable)
        if report.no_pool and not self._no_pool:
            self._no_pool = report.no_pool
            log.info("kvoffload: a worker found no pool (%s); requests do not wait for it",
                     report.no_pool)  # fmt: skip
        if report.registration is not None and report.registration != self._registration:
            reg = self._registration = report.registration
            self._rpc.submit(lambda: self._register(reg))
        for job_id, n in report.done.items():
            job = self._jobs.get(job_id)
            if job is not None:
                job.done += n
                self._maybe_complete(job)
        for job_id, n in report.failed.items():
            job = self._jobs.get(job_id)
            if job is not None:
                job.failed += n
                self._maybe_complete(job)

    def request_finished(
        self, request: Any, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Never delays the free: blocks with pending stores/loads hold our reference."""
        ctx = self._plan_context()
        if self.cfg.mode is StoreMode.LAZY and self.block_pool is not None:
            self._stores.remember_for_lazy(request, block_ids, ctx)
        # a deferred request (finished before its first token was out) is planned now
        self._reserve(self._stores.plan_finished(request.request_id, block_ids, ctx))
        self._stores.forget(request.request_id)
        self._schedulable.pop(request.request_id, None)
        self._first_token.discard(request.request_id)
        st = self._reqs.pop(request.request_id, None)
        if st is not None and st.answer is not None and st.load_job is None:
            self._release(st.answer.pins)
        return False, None

    def has_pending_work(self) -> bool:
        return bool(
            self._jobs
            or self._reservations_in_flight
            or self._lookups_in_flight
            or self._refreshes_in_flight
            or self._results
            or self._stores_out
            or self._stores.has_waiting()
            or self._loads_out
        )

    def shutdown(self) -> None:
        self._missed_reported_at = self._oldest_miss_at = float("-inf")
        self._count_presence_misses()  # the last ones, before the RPC thread drains
        if self.event_feed is not None:
            self.event_feed.close()
        self._rpc.close()
        self.client.close()
