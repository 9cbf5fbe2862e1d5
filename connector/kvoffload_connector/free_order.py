"""vLLM's deferred block frees, turned off where they only cost (our loads are stream-ordered).

With async scheduling (the GPU default) a step may still be writing a request's KV blocks when
the scheduler frees them. Without a connector that is harmless: whatever writes a reallocated
block next is queued after that step on the same CUDA stream. vLLM (0.26 onwards) assumes a
consumer connector's load is not ordered so, and for any `kv_both`/`kv_consumer` connector keeps
freed blocks out of the pool until the step that may write them has returned
(`Scheduler.defer_block_free`). kvoffload's loads are ordered: the transfer engine records an
event on the compute stream and makes its copy stream wait for it before every copy
(transfer/cuda.py), and the CPU engine copies synchronously. The deferral buys us nothing and
costs what users see: `reset_prefix_cache(reset_running_requests=True)` (the
`/reset_prefix_cache` endpoint, in-process weight updates) raises while a step is in flight,
where the same engine without a connector succeeds, and freed blocks come back a step late.

vLLM gives a connector no handle on its scheduler; the scheduler is the caller of
`bind_gpu_block_pool` (0.26) / `bind_kv_cache_manager` (0.32+), from its constructor, so the
facade passes its caller's `self` here. Anything unexpected (another caller such as
MultiConnector, whose other connectors may need the deferral; a vLLM without the attribute;
frees already deferred) leaves vLLM as it is.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def stop_deferring_block_frees(scheduler: Any, block_pool: Any) -> bool:
    """Turn off `scheduler.defer_block_free` when `scheduler` is the vLLM scheduler that owns
    `block_pool` and nothing has been deferred yet. True when it was turned off."""
    if scheduler is None or getattr(scheduler, "defer_block_free", None) is not True:
        return False
    manager = getattr(scheduler, "kv_cache_manager", None)
    if block_pool is None or getattr(manager, "block_pool", None) is not block_pool:
        return False
    if getattr(scheduler, "deferred_frees", None):  # created later than the bind in 0.26-0.32
        return False
    scheduler.defer_block_free = False
    log.info(
        "kvoffload: vLLM's deferred block frees are off for this engine: kvoffload's loads "
        "wait for the compute stream, so blocks free as they do without a connector"
    )
    return True
