"""The scheduler's counters for vLLM's stats (no torch).

`SchedulerStats` is the scheduler-side half of `ConnectorStats`. Counted stats are held back
while the output vLLM is building carries a request's first token (its stat loggers run before
the token is streamed), for `_STATS_HOLD_MAX_S` at most. Part of `OffloadScheduler`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

# the scheduler side logs as one logger, whichever part of it speaks
log = logging.getLogger("kvoffload_connector.scheduler")


# counted stats wait at most this long for an output that carries no request's first token
_STATS_HOLD_MAX_S = 1.0


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


def as_dict(stats: SchedulerStats) -> dict[str, float]:
    return dataclasses.asdict(stats)


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
