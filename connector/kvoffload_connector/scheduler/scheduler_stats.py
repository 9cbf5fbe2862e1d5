"""The scheduler's counters for vLLM's stats (no torch).

`SchedulerStats` is the scheduler-side half of `ConnectorStats`. Counted stats are held back
while the output vLLM is building carries a request's first token (its stat loggers run before
the token is streamed), for `_STATS_HOLD_MAX_S` at most. Part of `OffloadScheduler`.

Beside the counters, the stats carry `pool` (`pool_entry`): which pool this engine is
registered with and its namespace's capacity, for the `vllm:kvoffload_pool_*` series
(pool_metrics.py), in the process that serves vLLM's /metrics. It goes with the first stats
after each registration and again every `_POOL_RESEND_S` with counted stats (an offline engine
of some vLLM releases drops stats that come without a request's tokens).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

# the scheduler side logs as one logger, whichever part of it speaks
log = logging.getLogger("kvoffload_connector.scheduler")


# counted stats wait at most this long for an output that carries no request's first token
_STATS_HOLD_MAX_S = 1.0
# the pool's name goes again with counted stats this often (it changes only by registering)
_POOL_RESEND_S = 30.0


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
    pool: dict[str, Any] = field(default_factory=dict)  # pool_entry(), when it is due


def as_dict(stats: SchedulerStats) -> dict[str, Any]:
    return dataclasses.asdict(stats)


def pool_entry(registration: Any, chunk_tokens: int, num_groups: int) -> dict[str, Any]:
    """The pool a registration names and its namespace's capacity: bytes of its slots (every
    rank's part) and the tokens they hold (slots x chunk tokens / KV groups, the sidecar's
    count). Empty without a registration that names its pool."""
    pool = getattr(registration, "pool", None)
    regions = getattr(registration, "regions", ())
    if pool is None or not pool.pool_id:
        return {}
    slots = regions[0].slot_count if regions else 0
    return {
        "placement": pool.placement,
        "pool_id": pool.pool_id,
        "node_pool": pool.node_pool,
        "node": pool.node,
        "tenant": pool.tenant,
        "pool_bytes": pool.pool_bytes,
        "pool_namespace": registration.namespace_id,
        "capacity_bytes": slots * sum(r.slot_bytes for r in regions),
        "capacity_tokens": slots * chunk_tokens // max(1, num_groups),
    }


class StatsReporting:
    """Stats for vLLM (a part of `OffloadScheduler`)."""

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
            or self.client.registration is not self._pool_sent_for
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
        now = self._stats_taken_at = self._clock()
        reg = self.client.registration
        if reg is not self._pool_sent_for or now - self._pool_sent_at >= _POOL_RESEND_S:
            self._pool_sent_for, self._pool_sent_at = reg, now
            s.pool = pool_entry(reg, self.chunk_tokens, self.num_groups)
        return s
