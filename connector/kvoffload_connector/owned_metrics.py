"""The connector's Prometheus collectors in this process: the engine built last owns the names.

vLLM makes its collectors in prometheus_client's default registry (what its /metrics serves)
and, when an engine starts, unregisters the `vllm:` ones an earlier engine of the process left.
The connector does the same for every collector it made, whatever its name: a second engine
in one process (an offline `LLM(...)` after another, a test, a drill) then exports its own
numbers, and the first engine's collectors are gone from /metrics instead of holding the names.

`take_names()` unregisters what the connector made before; `make(cls, ...)` makes one collector
and remembers it. A collector that cannot be made (its name taken by something else) is left
out alone: the engine serves on without that series.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

from prometheus_client import REGISTRY

log = logging.getLogger(__name__)

_lock = threading.Lock()
_made: list[Any] = []  # every collector made since the last take_names()


def take_names() -> None:
    """Unregister the collectors the connector made earlier in this process (vLLM's own
    `vllm:` sweep may have removed some already; collectors made in another registry, or by
    vLLM's Ray wrappers, are not in this one)."""
    with _lock:
        earlier = list(_made)
        _made.clear()
    for collector in earlier:
        with contextlib.suppress(KeyError, TypeError):
            REGISTRY.unregister(collector)


def make(cls: Any, **kwargs: Any) -> Any | None:
    """`cls(**kwargs)`, remembered for the next `take_names()`; None when it cannot be made."""
    try:
        collector = cls(**kwargs)
    except Exception:  # noqa: BLE001 - a series is never worth the engine
        log.debug("kvoffload: no series %s", kwargs.get("name"), exc_info=True)
        return None
    with _lock:
        _made.append(collector)
    return collector
