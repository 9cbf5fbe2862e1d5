"""The scheduler's lookups: when a request asks the pool, and what vLLM is told (no torch).

`get_num_new_matched_tokens` asks inline for a request alone in the engine (or within
`inline_lookup_ms`); otherwise it queues the request's chunk keys and answers `None` ("ask me
next step"), and the step's queued lookups go out as one background batch. The round trips
themselves (look up and pin; windows first for sliding-window models) are `pool_lookup.py`'s.
The pinned prefix is the answer (block-aligned, never the last prompt token: the n-1 rule); a
presence-map miss needs no round trip, and is told to the sidecar's counters in one background
Lookup every `miss_report_ms`. A stale, shorter answer is refreshed once per `refresh_steps`.
Part of `OffloadScheduler` (scheduler.py), whose state it reads and writes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

from kvoffload_connector.common.client import PoolUnavailable
from kvoffload_connector.common.config import LoadMode
from kvoffload_connector.common.keys import PoolKey, chunk_keys, in_epoch
from kvoffload_connector.scheduler.pool_lookup import LookupAnswer, LookupBatch
from kvoffload_connector.scheduler.req_state import ReqState, cache_salt

# the scheduler side logs as one logger, whichever part of it speaks
log = logging.getLogger("kvoffload_connector.scheduler")


_MISS_REPORT_MAX = 1024  # presence-map misses kept for one report at most


class LookupAnswers:
    """Lookups and their answers to vLLM (a part of `OffloadScheduler`)."""

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
        loadable = self._loadable_chunks(st.answer)
        if loadable < st.answer.hit_chunks:
            # slots past a rank's registered pieces: those chunks are computed, never waited
            # for (a rank registers a big region in ~0.1 s per GiB)
            cut = st.answer.hit_chunks - loadable
            self.unregistered_hit_chunks += max(0, cut - st.unregistered)  # once per chunk
            st.unregistered = max(st.unregistered, cut)
            if not loadable and st.load_job is None:
                self._release(st.answer.pins)
                st.answer = LookupAnswer(0, [], [], "")
        hit_end = min(loadable * self.chunk_tokens, cap)
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


def _salts(reqs: Sequence[ReqState]) -> dict[str, str] | None:
    """The cache salts of requests that have one, by request id (None: no request has)."""
    salts = {st.req_id: salt for st in reqs if (salt := cache_salt(st.request))}
    return salts or None
