"""vLLM's prefix-cache reset, with our block references out of its way.

vLLM resets its GPU prefix cache (`/reset_prefix_cache`, benchmarks, and `pause_generation` /
`sleep`, which clear caches around a weight update) only when every GPU block is free, and with
`reset_running_requests` a refusal raises. Without a connector the blocks are free once the
running requests are preempted or aborted; with ours, loads and stores still in flight hold a
reference on theirs, and vLLM would refuse (or raise) where it did not before. The pool's block
pool has no hook before that check, so this guard wraps the one pool object the scheduler was
given (`BlockPool.reset_prefix_cache`, instance attribute only, vLLM's class untouched): the
scheduler decides first whether giving its references back makes the reset succeed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_MARK = "_kvoffload_reset_guard"


def install_reset_guard(block_pool: Any, before_reset: Callable[[], None]) -> bool:
    """Call `before_reset()` ahead of each `block_pool.reset_prefix_cache()`. Once per pool;
    False where the pool has no such method (nothing to guard). `before_reset` never stops
    the reset: anything it raises is logged and the reset goes on."""
    original = getattr(block_pool, "reset_prefix_cache", None)
    if original is None or getattr(block_pool, _MARK, False):
        return False

    def reset_prefix_cache(*args: Any, **kwargs: Any) -> Any:
        try:
            before_reset()
        except Exception:  # noqa: BLE001 - our bookkeeping must never fail vLLM's reset
            log.warning("kvoffload: preparing for vLLM's prefix-cache reset failed", exc_info=True)
        return original(*args, **kwargs)

    block_pool.reset_prefix_cache = reset_prefix_cache
    setattr(block_pool, _MARK, True)
    return True
