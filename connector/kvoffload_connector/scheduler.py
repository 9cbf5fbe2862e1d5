"""Scheduler side of the connector: lookups, loads, store reservations, fencing (no torch).

Runs in vLLM's EngineCore process on the scheduler thread. Network calls go to
one `RpcThread` (all but the inline lookups below, bounded by their deadline),
and their answers come back through a deque that the scheduler drains at its
next hook.

- Lookups: `get_num_new_matched_tokens` asks inline for a request alone in the
  engine (or within `inline_lookup_ms`); otherwise it queues the request's chunk
  keys and answers `None` ("ask me next step"), and `build_connector_meta` sends
  the step's queued lookups as one batch. The round trips themselves (look up and
  pin in one round of `ReserveLoad`s; windows first for sliding-window models)
  are `pool_lookup.py`'s. The pinned prefix is the answer (block-aligned, never
  the last prompt token: the n-1 rule); a presence-map miss needs no round trip.
- Stores: which chunks to store, and when, is `store_plan.py`'s: eager mode
  plans every chunk that is full after this step (while half of the GPU cache
  is free, a request's plan waits until its first token has left the engine:
  the request's own blocks hold the bytes meanwhile); lazy mode plans only
  chunks of finished requests whose GPU blocks reached the head of vLLM's free
  queue (next to be evicted). Either way the chunk's GPU blocks get a reference
  (`BlockPool.touch`) here when planned and lose it when the store job finished
  on every rank, so no block is reused before its bytes are in the pool: this
  fences request completion, preemption and sliding-window frees alike. Slots
  come from a batched `ReserveStore`; the job goes to the workers in the step
  after the reservation answered.
- Completion: workers report per-job outcomes in `WorkerReport`; a job is
  complete when every rank reported it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvoffload_connector.client import PoolClient, PoolUnavailable, RpcThread
from kvoffload_connector.config import ConnectorConfig, LoadMode, StoreMode
from kvoffload_connector.engine_lock import MAX_ENGINE
from kvoffload_connector.events import EventFeed
from kvoffload_connector.first_token import FirstTokenWatch
from kvoffload_connector.keys import PoolKey, chunk_keys, in_epoch
from kvoffload_connector.metadata import (
    ConnectorMeta,
    GroupTransfer,
    LoadJob,
    Registration,
    StoreJob,
    WorkerReport,
)
from kvoffload_connector.pool_lookup import LookupAnswer, LookupBatch, PoolLookup
from kvoffload_connector.req_state import ReqState, cache_salt
from kvoffload_connector.reset_guard import install_reset_guard
from kvoffload_connector.reuse import ReuseTracker
from kvoffload_connector.store_plan import PlanContext, PlannedChunk, StorePlan, StorePlanner

log = logging.getLogger(__name__)

STORE_NEW = 1  # pool_pb2.STORE_DECISION_NEW (kept numeric: no proto import on this path)


@dataclass
class _Job:
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


@dataclass
class SchedulerStats:
    """Counters since the last `take_stats` (scheduler-side half of ConnectorStats)."""

    lookups: int = 0
    lookup_seconds: float = 0.0
    hit_tokens: int = 0
    queried_tokens: int = 0
    store_chunks_planned: int = 0
    store_chunks_dropped: int = 0
    store_chunks_below_threshold: int = 0
    presence_misses: int = 0  # misses the sidecar's presence map answered: no round trip
    # times vLLM was told "not yet" (None) for a request: it skips the request that step and may
    # give its free blocks to one behind it (a preempted request at the head waits longer)
    lookup_waits: int = 0  # its first lookup (or a rank's pool) was not answered yet
    refresh_waits: int = 0  # a background refresh of a stale answer was in flight
    cache_resets: int = 0  # vLLM reset the connector's cache: earlier entries are not looked up


_MISS_REPORT_MAX = 1024  # presence-map misses kept for one report at most
# counted stats wait at most this long for an output that carries no request's first token
_STATS_HOLD_MAX_S = 1.0


class OffloadScheduler:
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
    ):
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
        # workers hold their ranks' locks for it (engine_lock.py); fresh per engine start.
        self.engine = secrets.randbelow(MAX_ENGINE - 1) + 1
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
        self._jobs: dict[int, _Job] = {}
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
        self._lookup_ewma_s = 0.0  # recent lookup round trips (inline and background)
        self._registration: Registration | None = None
        self._no_pool = (
            ""  # a worker's reason for having no pool (stops the first-registration wait)
        )
        self._ready: dict[int, bool] = {}  # rank -> pool ready (empty: not reported yet)
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

    # -- wiring -------------------------------------------------------------------------
    def bind(self, kv_cache_manager: Any = None, block_pool: Any = None) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.block_pool = (
            block_pool if block_pool is not None else getattr(kv_cache_manager, "block_pool", None)
        )
        self._stores.bind(self.kv_cache_manager, self.block_pool)
        if self.block_pool is not None:
            install_reset_guard(self.block_pool, self._before_gpu_reset)

    @property
    def registered(self) -> bool:
        return self.client.connected

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

    # -- lookups ------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens loadable beyond `num_computed_tokens`; None while the lookup is in flight."""
        req_id = request.request_id
        n_full = len(request.block_hashes) // self.chunk_blocks
        # n-1 rule: the last prompt token is always computed, so at most this many tokens hit.
        cap = (request.num_tokens - 1) // self.block_size * self.block_size
        st = self._reqs.get(req_id) or self._new_req(request)
        if n_full == 0 or min(n_full * self.chunk_tokens, cap) <= num_computed_tokens:
            self._schedulable.setdefault(req_id, self._step)
            return 0, False
        if self._results:
            self._drain()
        if st.answer is not None and st.load_job is None and not self._answer_alive(st.answer):
            st.answer = None  # its pins ended with their registration: ask again
        if st.answer is None:
            if not st.queued:
                if (
                    not self._usable()
                    and not self._may_wait_for_registration()
                    and not self._waiting_for_ranks()
                ):
                    self._tell_unusable()
                    return 0, False
                self.stats.queried_tokens += request.num_tokens - num_computed_tokens
                if self._usable() and self._surely_absent(request):
                    st.answer = LookupAnswer(0, [], [], "")  # the lookup's answer, without asking
                    st.answer_step = self._step
                    self.stats.presence_misses += 1
                    if not self._presence_missed:
                        self._oldest_miss_at = self._clock()
                    self._presence_missed.append(
                        (
                            cache_salt(request),
                            request.block_hashes,  # the prompt's hashes never change
                            self._usable_chunks(request),
                            self._key_epoch,
                        )
                    )
                    self._schedulable.setdefault(req_id, self._step)
                    return 0, False
                st.queued = True
                if self._may_look_up_inline(req_id):
                    self._look_up_inline(st)
                else:
                    self._lookup_queue.append(st)
            if st.answer is None:
                self.stats.lookup_waits += 1
                return None, False
        if st.answer.hit_chunks and not self._ranks_ready():
            if self._waiting_for_ranks():
                self.stats.lookup_waits += 1
                return None, False  # a hit: worth waiting for the ranks' device registration
            self._release(st.answer.pins)  # waited long enough: recompute
            st.answer = LookupAnswer(0, [], [], "")
        if self._refresh_due(st, min(n_full, cap // self.chunk_tokens)) and not self._refresh(st):
            self.stats.refresh_waits += 1
            return None, False  # asked again in the background: admitted with it next step
        hit_end = min(st.answer.hit_chunks * self.chunk_tokens, cap)
        st.hit_end = hit_end
        queueing = self._queueing()
        self._schedulable.setdefault(req_id, self._step)
        if hit_end <= num_computed_tokens:
            return 0, False
        mode = self.cfg.load_mode
        st.load_async = mode is LoadMode.ASYNC or (mode is LoadMode.ADAPTIVE and queueing)
        return hit_end - num_computed_tokens, st.load_async

    def _answer_alive(self, answer: LookupAnswer) -> bool:
        """The registration that pinned the answer's slots is the live one (else the sidecar
        has released, or will release, its pins: nothing may be loaded from it)."""
        if not answer.pins or answer.registration is None:
            return True
        return answer.registration is self.client.registration and self.client.connected

    def _new_req(self, request: Any) -> ReqState:
        """A request's first visit: its state, and (store_threshold) one more ask of each of
        its full chunks."""
        st = self._reqs[request.request_id] = ReqState(request.request_id, request)
        self._first_token.add(request.request_id)
        if self.reuse.enabled:
            gating = self.reuse.gating
            self.reuse.count(self._stores.reuse_keys(request))
            st.store_gated = self.reuse.gating  # as it came: its plan may be steps later
            if self.reuse.auto and st.store_gated != gating:
                self._say_gate()
        return st

    def _say_gate(self) -> None:
        """`store_threshold: auto` opened or closed its gate: the first close is said at INFO
        (why stores stopped), every later change at DEBUG (mixed traffic may flip it often);
        the chunks it skips count in `store_chunks_below_threshold`."""
        gated = self.reuse.gating
        level = logging.INFO if gated and not self._gate_said else logging.DEBUG
        self._gate_said = self._gate_said or gated
        log.log(
            level,
            "kvoffload: %s (store_threshold auto)",
            f"no chunk repeated in {self.reuse.window} requests: storing only chunks asked "
            "for twice"
            if gated
            else "a request repeated a chunk: storing every chunk again",
        )

    def _queueing(self) -> bool:
        """The engine is saturated: a request answered in an earlier step is still waiting to
        be admitted (vLLM's token or sequence budget, or free blocks, held it back)."""
        step = self._step
        return any(s < step for s in self._schedulable.values())

    def _may_look_up_inline(self, req_id: str) -> bool:
        """A request alone in the engine asks inline: the round trip delays nobody. With
        company it asks inline while this step's inline lookups stay within
        `inline_lookup_ms` and recent round trips were that fast: a round trip on the scheduler
        thread costs the running requests ~0.1-0.3 ms, a background answer costs the new
        request a whole engine step. Past the budget (a burst, a slow sidecar) lookups batch
        in the background."""
        if not (self.cfg.inline_lookup and self._usable() and not self._lookup_queue):
            return False
        if len(self._reqs) == 1 and req_id in self._reqs:
            return True
        budget_s = self.cfg.inline_lookup_ms / 1e3
        return self._inline_spent_s + self._lookup_ewma_s < budget_s

    def _surely_absent(self, request: Any) -> bool:
        """The sidecar's presence map (presence.py) says the request's first chunk is not in
        the pool, so no prefix of it is: a miss without a round trip. Full attention only (a
        sliding-window hit is not a plain prefix); any doubt means ask."""
        presence = getattr(self.client, "presence", None)  # stand-ins may lack it
        if presence is None or self.sliding or len(request.block_hashes) < self.chunk_blocks:
            return False
        try:
            return not presence.maybe_present(
                in_epoch(
                    chunk_keys(request.block_hashes, self.chunk_blocks, 0, 1), self._key_epoch
                )[0]
            )
        except (ValueError, IndexError, OSError):  # a map closed under us: ask
            return False

    def _count_presence_misses(self) -> None:
        """Tell the sidecar about the presence-map misses in one background Lookup every
        `miss_report_ms` (or once `_MISS_REPORT_MAX` requests wait), so its lookup counters and
        hit rates (per namespace and tenant) still count every request asked about; off the
        requests' path, which was answered already. Not while a request waits for its first
        token: an idle engine takes no steps, so the first step after `miss_report_ms` is
        mostly the one that schedules the next prefill, and the round trip and the sidecar's
        answer would run beside its launch (measured: kvoffload's requests fell into the GPU VM's
        slow TTFT mode more often than the others'). Held twice `miss_report_ms` at most."""
        if not self._presence_missed:
            return
        now = self._clock()
        if len(self._presence_missed) < _MISS_REPORT_MAX:
            period_s = self.cfg.miss_report_ms / 1e3
            if now - self._missed_reported_at < period_s:
                return
            if now - self._oldest_miss_at < 2 * period_s and self._first_token.any_pending():
                return
        self._missed_reported_at = now
        batch, self._presence_missed = self._presence_missed, []
        timeout_s = self.cfg.lookup_timeout_ms / 1e3

        def count() -> None:
            queries = [
                keys
                for _, hashes, limit, epoch in batch
                for keys in self._group_keys(hashes, limit, epoch)
            ]
            salts = [salt for salt, *_ in batch for _ in range(self.num_groups)]
            with contextlib.suppress(PoolUnavailable):
                self.client.lookup(queries, timeout_s=timeout_s, salts=salts, report_misses=True)

        self._rpc.submit(count)

    def _look_up_inline(self, st: ReqState) -> None:
        """The lookup and its pins in this scheduling call (deadline: `lookup_timeout_ms`), so
        the request's hit (or miss) is scheduled now, not after an engine step."""
        self._lookups_in_flight += 1
        t0 = time.perf_counter()
        self._lookup_rpc([(st.req_id, self._request_keys(st.request))], _salts([st]))
        self._inline_spent_s += time.perf_counter() - t0
        self._drain()

    def _usable(self) -> bool:
        """Connected, and every rank has its pool mapped and device-registered."""
        return self.client.connected and self._ranks_ready()

    def _ranks_ready(self) -> bool:
        return not self._ready or (
            len(self._ready) >= self.world_size and all(self._ready.values())
        )

    def _waiting_for_ranks(self) -> bool:
        """Connected while a rank maps the pool for its device, for at most `ready_wait_ms`
        since it started: lookups still run, and a request that hits waits for it (a miss
        does not)."""
        since = self._unready_since
        return (
            since is not None
            and not self._no_pool
            and self.client.connected
            and (self._clock() - since) * 1e3 < self.cfg.ready_wait_ms
        )

    def _unusable_reason(self) -> str:
        if not self.client.connected:
            if self._registration is None:
                return "no worker has reported a registration yet"
            return "the sidecar is away or refused the registration (retrying)"
        missing = [r for r in range(self.world_size) if not self._ready.get(r)]
        return f"rank(s) {missing} have no mapped pool"

    def _tell_unusable(self) -> None:
        """One log line per reason (not per step) for serving without the pool."""
        reason = self._unusable_reason()
        if reason != self._told_unusable:
            self._told_unusable = reason
            log.info("kvoffload: serving without the pool (lookups miss, stores drop): %s", reason)

    def _may_wait_for_registration(self) -> bool:
        """Before the first registration, requests wait (bounded) instead of missing; not once a
        rank said it found no pool (a degraded sidecar, a layout it cannot map)."""
        if self._registration is not None and self.client.registrations > 0:
            return False  # registered before: the sidecar is away, do not wait for it
        if self._no_pool:
            return False
        now = self._clock()
        if self._first_query_at is None:
            self._first_query_at = now
        return (now - self._first_query_at) * 1e3 < self.cfg.register_wait_ms

    def _refresh_due(self, st: ReqState, possible_chunks: int) -> bool:
        """A request vLLM visits again whose answer is `refresh_steps` steps old and shorter
        than its prompt allows. Under load vLLM walks past requests whose lookups are still out
        and asks the ones behind them, so a request is often answered long before it reaches
        the queue's head; the prefix another request was computing then is in the pool by the
        time it is admitted, and a stale miss would compute it again (H100 sweep, 32 QPS: 25%
        more prefill tokens than vLLM's OffloadingConnector, which looks up on every visit)."""
        return bool(
            self.cfg.refresh_steps
            and not st.refreshing
            and st.load_job is None
            and st.answer is not None
            and st.answer.hit_chunks < possible_chunks
            and self._step - st.answer_step >= self.cfg.refresh_steps
            and self._usable()
        )

    def _refresh(self, st: ReqState) -> bool:
        """Ask again for `st`: inline within the step's budget (True: its answer is fresh now),
        else in the background (False: the request waits one step for it, never longer, since
        a refresh in flight is not due again)."""
        if self._surely_absent(st.request):  # still nothing in the pool: the answer stands
            st.answer_step = self._step
            return True
        st.refreshing = True
        self._refreshes_in_flight += 1
        batch, salts = [(st.req_id, self._request_keys(st.request))], _salts([st])
        if self._may_look_up_inline(st.req_id):
            t0 = time.perf_counter()
            self._lookup_rpc(batch, salts, kind="refresh")
            self._inline_spent_s += time.perf_counter() - t0
            self._drain()
            return True
        self._rpc.submit(lambda: self._lookup_rpc(batch, salts, kind="refresh"))
        if st.waited_for_refresh:
            # Passed over once already: each None lets vLLM give the step's free blocks to a
            # request behind this one, and a request that waits long (a preempted one, back at
            # the head) would lose its turn every `refresh_steps`. It goes with what it has;
            # the answer still grows if it is not admitted in this step.
            return True
        st.waited_for_refresh = True
        return False

    def _adopt_refresh(self, st: ReqState | None, answer: LookupAnswer | None) -> None:
        """A refresh's answer replaces the request's when it is longer and nothing loads yet;
        otherwise its pins go back."""
        if st is not None:
            st.refreshing = False
        keep = (
            st is not None
            and answer is not None
            and st.answer is not None
            and st.load_job is None
            and not st.queued
            and st.req_id in self._schedulable  # not admitted meanwhile with the older answer
            and answer.hit_chunks > st.answer.hit_chunks
        )
        if not keep:
            if answer is not None and answer.pins:
                self._release(answer.pins)
            if st is not None and st.answer is not None:
                st.answer_step = self._step  # asked again in refresh_steps steps
            return
        assert st is not None and st.answer is not None and answer is not None
        self._release(st.answer.pins)
        st.answer = answer
        st.answer_step = self._step
        self.refreshed_hits += 1

    def _send_lookups(self) -> None:
        if not self._lookup_queue:
            return
        if not self._usable() and not self._waiting_for_ranks():
            self._rpc.submit(self.client.ensure)  # reconnects when its backoff allows
            if self._may_wait_for_registration():
                return  # keep them queued: the first registration is on its way
            self._tell_unusable()
            for st in self._lookup_queue:  # sidecar away: every queued lookup is a miss
                st.queued = False
                st.answer = LookupAnswer(0, [], [], "")
            self._lookup_queue = []
            return
        self._told_unusable = ""
        batch = [(st.req_id, self._request_keys(st.request)) for st in self._lookup_queue]
        salts = _salts(self._lookup_queue)
        self._lookup_queue = []
        self._lookups_in_flight += 1
        self._rpc.submit(lambda: self._lookup_rpc(batch, salts))

    def _request_keys(self, request: Any) -> list[list[PoolKey]]:
        """Chunk keys per group, only as many chunks as the n-1 rule lets a hit use."""
        return self._group_keys(request.block_hashes, self._usable_chunks(request), self._key_epoch)

    def _group_keys(
        self, hashes: Sequence[bytes], limit: int, epoch: bytes | None
    ) -> list[list[PoolKey]]:
        """Per group, the keys of the first `limit` chunks, named in `epoch`."""
        return [
            in_epoch(chunk_keys(hashes, self.chunk_blocks, g, limit), epoch)
            for g in range(self.num_groups)
        ]

    def _usable_chunks(self, request: Any) -> int:
        """Chunks a hit may use (the n-1 rule: the last prompt token is always computed)."""
        usable = (request.num_tokens - 1) // self.block_size * self.block_size
        return -(-usable // self.chunk_tokens)

    def window_start(self, group: int, hit_chunks: int) -> int:
        return self._lookup.window_start(group, hit_chunks)

    def _lookup_rpc(
        self,
        batch: LookupBatch,
        salts: dict[str, str] | None = None,
        kind: str = "lookup",
    ) -> None:
        """Background (or inline for a lone request): the batch's hits, pinned (`salts`: the
        requests' cache salts, by request id, for the sidecar's per-tenant counts), through
        `PoolLookup`: one pipelined round of ReserveLoads for full attention, a Lookup (two
        for partial hits) then the pins with sliding-window groups. The answers, and the
        lookup's latency, go to `_results` for the scheduler thread."""
        answers: list[tuple[str, LookupAnswer | None]] = []
        t0 = time.perf_counter()
        timeout_s = self.cfg.lookup_timeout_ms / 1e3
        try:
            # Never (re)register here: a Register against a silent sidecar would hold this
            # batch's requests for its whole timeout. `_send_lookups` schedules `ensure`.
            if not self.client.connected:
                raise PoolUnavailable("not connected")
            generation = self.client.registration.generation if self.client.registration else ""
            if not self.sliding:  # full attention only: look up and pin in one round trip
                answers = self._lookup.pin_prefixes(batch, generation, timeout_s, salts)
                self._results.append(("lookup_seconds", time.perf_counter() - t0))
                self._results.append((kind, answers))
                self._answered.set()
                return
            hits = self._lookup.hybrid_hits(batch, timeout_s, salts)
            self._results.append(("lookup_seconds", time.perf_counter() - t0))
            answers = self._lookup.pin_all(batch, hits, generation)
        except PoolUnavailable as e:
            log.debug("kvoffload: lookup failed (miss): %s", e)
            done = {r for r, _ in answers}
            answers += [(req_id, None) for req_id, _ in batch if req_id not in done]
        self._results.append((kind, answers))
        self._answered.set()

    def _release(self, pins: Sequence[int]) -> None:
        pins = list(pins)
        if pins:
            self._rpc.submit(lambda: self._release_now(pins))

    def _release_now(self, pins: list[int]) -> None:
        self._lookup.release_now(pins)

    # -- loads --------------------------------------------------------------------------
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
        self._jobs[job_id] = _Job(job_id, "load", (st.req_id,), held, pins=answer.pins)
        st.load_job = job_id
        st.stored_chunks = max(st.stored_chunks, answer.hit_chunks)
        self.stats.hit_tokens += num_external_tokens
        layered = not st.load_async
        self._loads_out.append(
            LoadJob(job_id, st.req_id, tuple(transfers), generation, layered, tuple(versions))
        )

    # -- stores -------------------------------------------------------------------------
    def _touch(self, blocks: list[Any]) -> None:
        if self.block_pool is not None and blocks:
            self.block_pool.touch(blocks)

    def _untouch(self, blocks: list[Any]) -> None:
        if self.block_pool is not None and blocks:
            self.block_pool.free_blocks(blocks)

    def _plan_context(self) -> PlanContext:
        """What a store plan reads of this scheduler now: the step, the key and event epochs."""
        feed = self.event_feed
        return PlanContext(self._step, self._key_epoch, feed.epoch if feed is not None else None)

    def take_events(self) -> list[Any]:
        """vLLM's `take_events`: the host tier's BlockStored/BlockRemoved since the last step."""
        return self.event_feed.take() if self.event_feed is not None else []

    def publish_events_through(self, publisher: Any) -> bool:
        """Announce the host tier through vLLM's own publisher from the feed's poll thread, so
        no engine step is needed (events.py); False: `take_events` stays the path."""
        return self.event_feed is not None and self.event_feed.publish_through(publisher)

    def _reserve(self, plan: StorePlan) -> None:
        """Reference the plan's blocks, then reserve its chunks (store_plan.py holds back those
        waiting for their request's first token)."""
        self.stats.store_chunks_below_threshold += plan.below_threshold
        planned = plan.chunks
        if not planned:
            return
        for p in planned:
            self._touch(p.blocks)
            p.gpu_resets = self._gpu_resets
        self.stats.store_chunks_planned += len(planned)
        self._send_reservation(self._stores.hold_for_first_token(planned, self._step))

    def _send_reservation(self, planned: list[PlannedChunk]) -> None:
        """Reserve slots for `planned` (blocks already held) in the background."""
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
        self._jobs[job_id] = _Job(
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

    def _output_count(self, req_id: str) -> int | None:
        """A live request's output-token count (None once finished or aborted)."""
        st = self._reqs.get(req_id)
        return getattr(st.request, "num_output_tokens", None) if st is not None else None

    # -- per step -----------------------------------------------------------------------
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
        if self.block_pool is not None:
            if self.cfg.mode is StoreMode.EAGER:
                ctx = self._plan_context()
                self._reserve(self._stores.plan_eager(scheduler_output, preempted or (), ctx))
            else:
                self._reserve(self._stores.plan_lazy())
        if self._stores.has_waiting():
            # a preempted request's blocks are wanted back: its stores leave now, not later
            self._send_reservation(self._stores.release_waiting(set(preempted or ()), self._step))
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

    def update_connector_output(self, report: WorkerReport | None) -> None:
        if report is None:
            return
        self._ready.update(report.ready)
        if self._ranks_ready():
            self._unready_since = None
        elif self._unready_since is None:
            self._unready_since = self._clock()
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

    def _register(self, reg: Registration) -> None:
        cur = self.client.registration
        if (
            self.client.connected
            and cur is not None
            and cur.namespace_id == reg.namespace_id
            and cur.generation == reg.generation
        ):
            # Already joined (we reconnected first): keep the session and the pins it owns.
            self.client.remember(reg.spec, reg.num_ranks, reg.slot_bytes_per_rank)
            return
        try:
            self.client.register(reg.spec, reg.num_ranks, reg.slot_bytes_per_rank)
        except PoolUnavailable as e:
            log.info("kvoffload: scheduler registration failed (will retry): %s", e)

    def _maybe_complete(self, job: _Job) -> None:
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

    def _restart(self, st: ReqState) -> None:
        """A preempted request's blocks are gone: look up and store again on resume."""
        st.stored_chunks = 0
        st.planned = False
        st.wait_from = -1
        st.waited_for_refresh = False  # waiting again: one more pass-over allowed
        if st.load_job is None and st.answer is not None:
            self._release(st.answer.pins)
            st.answer = None

    # -- vLLM's cache resets ------------------------------------------------------------
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

    def stats_pending(self) -> bool:
        """Anything counted since the last `take_stats` (cheap: no object built), and the
        output vLLM is building carries no request's first token (see `_first_token_out_now`)."""
        st = self.stats
        counted = bool(
            st.lookups
            or st.queried_tokens
            or st.hit_tokens
            or st.store_chunks_planned
            or st.store_chunks_dropped
            or st.store_chunks_below_threshold
            or st.presence_misses
            or st.lookup_waits
            or st.refresh_waits
            or st.cache_resets
        )
        return counted and not self._first_token_out_now()

    def _first_token_out_now(self) -> bool:
        """True when a request has exactly one output token: vLLM asks for stats after
        appending a step's tokens, so its first token is in the output being built. Stats in
        that output are handled by the API server's stat loggers before the token is streamed
        (vLLM 0.26 `output_handler`), and a request's own lookup is counted just before it:
        at light load every request's TTFT would carry them. Held for `_STATS_HOLD_MAX_S` at
        most (under load some request is always at its first token); nothing is dropped."""
        if self._clock() - self._stats_taken_at >= _STATS_HOLD_MAX_S:
            return False
        return self._first_token.any_in_this_output()

    def take_stats(self) -> SchedulerStats:
        s, self.stats = self.stats, SchedulerStats()
        self._stats_taken_at = self._clock()
        return s

    def shutdown(self) -> None:
        self._missed_reported_at = self._oldest_miss_at = float("-inf")
        self._count_presence_misses()  # the last ones, before the RPC thread drains
        if self.event_feed is not None:
            self.event_feed.close()
        self._rpc.close()
        self.client.close()


def _salts(reqs: Sequence[ReqState]) -> dict[str, str] | None:
    """The cache salts of requests that have one, by request id (None: no request has)."""
    salts = {st.req_id: salt for st in reqs if (salt := cache_salt(st.request))}
    return salts or None


def as_dict(stats: SchedulerStats) -> dict[str, float]:
    return dataclasses.asdict(stats)
