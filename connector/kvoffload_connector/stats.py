"""Connector metrics: `KVConnectorStats` for vLLM's log line, Prometheus counters for /metrics.

Both halves of the connector report plain counters (a dict of numbers);
vLLM sums the workers' dicts with the scheduler's (`aggregate`), logs
`reduce()` every interval ("KV Transfer metrics: ...") and feeds the same
dict to `PromMetrics.observe` for its Prometheus endpoint. The scheduler's
dict may also carry `pool`, the pool's name (pool_metrics.py): not summed,
the latest kept. The collectors are the last engine's of the process
(owned_metrics.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvoffload_connector import owned_metrics
from kvoffload_connector.pool_metrics import PoolSeries

# Counter names: one table, summed across ranks and steps.
COUNTERS = (
    "lookups",  # batched lookup exchanges
    "lookup_seconds",  # their total latency
    "hit_tokens",  # tokens vLLM will load from the pool instead of computing
    "queried_tokens",  # tokens asked about
    "store_chunks_planned",
    "store_chunks_dropped",  # sidecar away / no space
    "store_chunks_below_threshold",  # asked for fewer than store_threshold times: not stored
    "presence_misses",  # misses answered by the sidecar's presence map, without a lookup
    "lookup_waits",  # a request skipped for a step: its lookup was not answered yet
    "refresh_waits",  # a request skipped for a step: a refresh of its stale answer was out
    "cache_resets",  # vLLM reset the connector's cache (weight update): earlier entries unused
    "loaded_bytes",
    "load_seconds",
    "stored_bytes",
    "store_seconds",
    "failed_loads",
    "failed_stores",
    "pool_file_lost",  # the pool file shrank under a worker's mapping: it dropped the view
    "hook_faults",  # a connector hook raised: that process serves without the pool
)


@dataclass
class ConnectorStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def add(self, values: dict[str, Any]) -> None:
        for k, v in values.items():
            if isinstance(v, dict):  # a description (the pool's name), not a count: the latest
                if v:
                    self.data[k] = dict(v)
            elif v:
                self.data[k] = self.data.get(k, 0) + v

    def aggregate(self, other: KVConnectorStats) -> ConnectorStats:
        out = ConnectorStats(dict(self.data))
        out.add(dict(other.data))
        return out

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        gib = 1 << 30
        return {
            "hit_tokens": int(d.get("hit_tokens", 0)),
            "hit_rate": round(d.get("hit_tokens", 0) / max(1, d.get("queried_tokens", 0)), 3),
            "loaded_GiB": round(d.get("loaded_bytes", 0) / gib, 4),
            "stored_GiB": round(d.get("stored_bytes", 0) / gib, 4),
            "load_GBps": round(
                d.get("loaded_bytes", 0) / 1e9 / max(d.get("load_seconds", 0), 1e-9), 2
            )
            if d.get("load_seconds")
            else 0.0,
            "store_GBps": round(
                d.get("stored_bytes", 0) / 1e9 / max(d.get("store_seconds", 0), 1e-9), 2
            )
            if d.get("store_seconds")
            else 0.0,
            "lookup_ms": round(1e3 * d.get("lookup_seconds", 0) / max(1, d.get("lookups", 0)), 3),
            "stores_dropped": int(d.get("store_chunks_dropped", 0)),
            "stores_below_threshold": int(d.get("store_chunks_below_threshold", 0)),
            "presence_misses": int(d.get("presence_misses", 0)),
            "lookup_waits": int(d.get("lookup_waits", 0)),
            "refresh_waits": int(d.get("refresh_waits", 0)),
            "failed_loads": int(d.get("failed_loads", 0)),
            "cache_resets": int(d.get("cache_resets", 0)),
            "hook_faults": int(d.get("hook_faults", 0)),
        }

    def is_empty(self) -> bool:
        return not any(self.data.values())


class PromMetrics(KVConnectorPromMetrics):
    """`kvoffload_connector_*` counters on vLLM's Prometheus endpoint, labelled per engine."""

    NAMES = {
        "hit_tokens": ("kvoffload_connector_hit_tokens_total", "Tokens loaded from the pool"),
        "queried_tokens": (
            "kvoffload_connector_queried_tokens_total",
            "Prompt tokens looked up in the pool",
        ),
        "loaded_bytes": ("kvoffload_connector_loaded_bytes_total", "Bytes copied pool -> GPU"),
        "stored_bytes": ("kvoffload_connector_stored_bytes_total", "Bytes copied GPU -> pool"),
        "load_seconds": ("kvoffload_connector_load_seconds_total", "Time spent in loads"),
        "store_seconds": ("kvoffload_connector_store_seconds_total", "Time spent in stores"),
        "lookups": ("kvoffload_connector_lookups_total", "Batched lookup exchanges"),
        "lookup_seconds": (
            "kvoffload_connector_lookup_seconds_total",
            "Total latency of batched lookups",
        ),
        "store_chunks_dropped": (
            "kvoffload_connector_dropped_store_chunks_total",
            "Chunks not stored (sidecar away, no space)",
        ),
        "store_chunks_below_threshold": (
            "kvoffload_connector_below_threshold_store_chunks_total",
            "Chunks not stored: asked for fewer than store_threshold times",
        ),
        "presence_misses": (
            "kvoffload_connector_presence_misses_total",
            "Misses answered by the sidecar's presence map, without a lookup round trip",
        ),
        "lookup_waits": (
            "kvoffload_connector_lookup_waits_total",
            "Steps a request was skipped because its pool lookup was not answered yet",
        ),
        "refresh_waits": (
            "kvoffload_connector_refresh_waits_total",
            "Steps a request was skipped while a refresh of its stale lookup answer was out",
        ),
        "cache_resets": (
            "kvoffload_connector_cache_resets_total",
            "Times vLLM reset the connector's cache (a weight update): earlier entries unused",
        ),
        "failed_loads": (
            "kvoffload_connector_failed_loads_total",
            "Loads that failed (recomputed by vLLM)",
        ),
        "pool_file_lost": (
            "kvoffload_connector_pool_file_lost_total",
            "Times a worker found the pool file shrunk under its mapping and dropped it",
        ),
        "hook_faults": (
            "kvoffload_connector_hook_faults_total",
            "Connector hooks that raised: each time, that process dropped the pool and served on",
        ),
    }

    # The same bytes and seconds under vLLM's own names (its OffloadingConnector's, the ones
    # llm-d's tiered-cache dashboards query), beside ours. Not where vLLM's OffloadingConnector
    # runs in this engine too (a MultiConnector): it registers these names itself.
    VLLM_NAMES = {
        "stored_bytes": (
            "vllm:kv_offload_store_bytes_total",
            "Total bytes stored from GPU to offload storage (kvoffload's pool).",
        ),
        "loaded_bytes": (
            "vllm:kv_offload_load_bytes_total",
            "Total bytes loaded from offload storage (kvoffload's pool) to GPU.",
        ),
        "store_seconds": (
            "vllm:kv_offload_store_time_total",
            "Total store time from GPU to offload storage, in seconds.",
        ),
        "load_seconds": (
            "vllm:kv_offload_load_time_total",
            "Total load time from offload storage to GPU, in seconds.",
        ),
    }

    ACTIVE = "vllm:kvoffload_pool_active"

    def __init__(
        self, vllm_config, metric_types, labelnames, per_engine_labelvalues, reason: str = ""
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # this engine's collectors replace those an earlier engine of the process made
        owned_metrics.take_names()
        self._counters = self._make_counters(self.NAMES, labelnames)
        self._aliases = (
            {}
            if _runs_vllm_offloading(vllm_config)
            else self._make_counters(self.VLLM_NAMES, labelnames)
        )
        self._children: dict[tuple[int, str, int], Any] = {}
        self.active_gauge = self._pool_active(list(labelnames), reason)
        self.pool = PoolSeries(self._gauge_cls, list(labelnames), per_engine_labelvalues)

    def _make_counters(self, names: dict[str, tuple[str, str]], labelnames: list[str]) -> dict:
        made = {
            key: owned_metrics.make(
                self._counter_cls, name=name, documentation=doc, labelnames=labelnames
            )
            for key, (name, doc) in names.items()
        }
        return {key: counter for key, counter in made.items() if counter is not None}

    def _pool_active(self, labelnames: list[str], reason: str) -> Any:
        """1 while the pool serves, 0 with the reason (the same text as the log line) when the
        engine serves without it. A failure here costs the gauge, never the engine."""
        gauge = owned_metrics.make(
            self._gauge_cls,
            name=self.ACTIVE,
            documentation="1 if kvoffload's pool serves this engine, else 0 with the reason",
            labelnames=[*labelnames, "reason"],
        )
        if gauge is None:
            return None
        try:
            for values in self.per_engine_labelvalues.values():
                gauge.labels(*values, reason).set(0 if reason else 1)
            return gauge
        except Exception:  # noqa: BLE001
            return None

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if not value:
                continue
            if key == "pool":
                self.pool.observe(value, engine_idx)
                continue
            for alias, table in enumerate((self._counters, self._aliases)):
                counter = table.get(key)
                if counter is None:
                    continue
                child = self._children.get((engine_idx, key, alias))
                if child is None:
                    child = counter.labels(*self.per_engine_labelvalues[engine_idx])
                    self._children[(engine_idx, key, alias)] = child
                child.inc(value)


def _runs_vllm_offloading(vllm_config: Any) -> bool:
    """Whether vLLM's OffloadingConnector runs in this engine beside kvoffload (a
    MultiConnector): it owns the `vllm:kv_offload_*` names there."""
    kv = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(kv, "kv_connector_extra_config", None) or {}
    subs = extra.get("connectors", []) if isinstance(extra, dict) else []
    names = [getattr(kv, "kv_connector", "")] + [
        c.get("kv_connector", "") for c in subs if isinstance(c, dict)
    ]
    return "OffloadingConnector" in names
