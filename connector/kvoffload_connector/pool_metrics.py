"""`vllm:kvoffload_pool_*`: which pool serves this engine, on vLLM's own /metrics.

A node pool answers through every replica of its tenant on the node, so a router, dashboard
or autoscaler that adds up what each replica's /metrics reports would count it once per
replica. These series name the pool by its `pool_id` (the same through every pod that shares
it: the Register answer's `pool`), so readers count capacity once per `pool_id`:

- `vllm:kvoffload_pool_info{placement, pool_id, node_pool, node, tenant}` 1;
- `vllm:kvoffload_pool_size_bytes{pool_id}`: the pool's bytes, every namespace;
- `vllm:kvoffload_pool_capacity_bytes{pool_id, pool_namespace}` and `..._capacity_tokens`:
  this engine's namespace (its compatibility domain) in the pool.

Each carries vLLM's engine labels. The scheduler sends the values with its stats (`pool`,
scheduler_stats.py); a new registration that names another pool (the pool rebuilt) replaces
the engine's series.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from kvoffload_connector import owned_metrics

log = logging.getLogger(__name__)

INFO = "vllm:kvoffload_pool_info"
SIZE = "vllm:kvoffload_pool_size_bytes"
CAPACITY_BYTES = "vllm:kvoffload_pool_capacity_bytes"
CAPACITY_TOKENS = "vllm:kvoffload_pool_capacity_tokens"
NAMES = (INFO, SIZE, CAPACITY_BYTES, CAPACITY_TOKENS)

_INFO_LABELS = ("placement", "pool_id", "node_pool", "node", "tenant")
# series -> (documentation, labels beside the engine's, the entry's value)
SERIES: dict[str, tuple[str, tuple[str, ...], str | None]] = {
    INFO: (
        "1 for the pool that serves this engine: count shared capacity once per pool_id",
        _INFO_LABELS,
        None,
    ),
    SIZE: ("Bytes of the pool, every namespace", ("pool_id",), "pool_bytes"),
    CAPACITY_BYTES: (
        "Bytes of the slots of this engine's namespace in the pool",
        ("pool_id", "pool_namespace"),
        "capacity_bytes",
    ),
    CAPACITY_TOKENS: (
        "Tokens the slots of this engine's namespace hold",
        ("pool_id", "pool_namespace"),
        "capacity_tokens",
    ),
}


class PoolSeries:
    """The four gauges, one child per engine: `observe(entry, engine_idx)` sets them."""

    def __init__(
        self, gauge_cls: Any, labelnames: list[str], per_engine_labelvalues: dict[int, list]
    ) -> None:
        self._engine_labels = per_engine_labelvalues
        self._gauges = {
            name: owned_metrics.make(
                gauge_cls,
                name=name,
                documentation=doc,
                labelnames=[*labelnames, *labels],
                multiprocess_mode="mostrecent",
            )
            for name, (doc, labels, _) in SERIES.items()
        }
        self._shown: dict[int, dict[str, tuple[Any, ...]]] = {}  # engine -> series -> labels

    def observe(self, entry: dict[str, Any], engine_idx: int = 0) -> None:
        """Never raises: it runs in vLLM's stat logger."""
        try:
            self._observe(entry, engine_idx)
        except Exception:  # noqa: BLE001 - a series is never worth the engine
            log.debug("kvoffload: pool series not updated", exc_info=True)

    def _observe(self, entry: dict[str, Any], engine_idx: int) -> None:
        engine = tuple(self._engine_labels.get(engine_idx, ()))
        shown = self._shown.setdefault(engine_idx, {})
        for name, (_, labels, key) in SERIES.items():
            gauge = self._gauges[name]
            if gauge is None:
                continue
            values = (*engine, *(str(entry.get(label, "")) for label in labels))
            old = shown.get(name)
            if old is not None and old != values:
                with contextlib.suppress(KeyError, AttributeError):
                    gauge.remove(*old)
            gauge.labels(*values).set(1 if key is None else float(entry.get(key, 0) or 0))
            shown[name] = values
