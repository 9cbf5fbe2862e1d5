"""What the scheduler side keeps of one vLLM request (no torch).

Its own module because two read it: the scheduler (scheduler.py: lookups, loads, completion)
and the store planner (store_plan.py), which must not import the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvoffload_connector.scheduler.pool_lookup import LookupAnswer


@dataclass
class ReqState:
    req_id: str
    request: Any  # vLLM Request (block_hashes, num_tokens, num_computed_tokens, ...)
    queued: bool = False  # lookup queued or in flight
    answer: LookupAnswer | None = None
    hit_end: int = 0  # tokens covered by the answer (after the n-1 cap)
    stored_chunks: int = 0  # chunks already in, or on their way to, the pool
    load_job: int | None = None
    planned: bool = False  # eager: seen by a store plan since it was (re)scheduled
    deferred_full: int = 0  # eager, deferred: chunks full when its plan was last put off
    wait_from: int = -1  # the step its stores began waiting for its first token (-1: not yet)
    load_async: bool = False  # the load mode last answered to vLLM for this request
    stale_lookup: bool = False  # its lookup in flight asked for keys of an earlier cache epoch
    answer_step: int = 0  # the step its answer came in
    refreshing: bool = False  # a second lookup in flight for a longer hit (waiting request)
    waited_for_refresh: bool = False  # it was passed over once for a background refresh
    store_gated: bool = False  # the reuse gate was closed when it came: chunks asked once wait
    unregistered: int = 0  # most chunks of its hit told as misses: past a rank's registered end


def cache_salt(request: Any) -> str | None:
    """A vLLM request's `cache_salt` (per-tenant prefix isolation); None when unset."""
    return getattr(request, "cache_salt", None) or None
