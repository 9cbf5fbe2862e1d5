"""Connector metrics: the KVConnectorStats vLLM logs and the Prometheus counters it exports."""

from __future__ import annotations

from kvoffload_connector.connector import KVOffloadConnector
from kvoffload_connector.stats import ConnectorStats, PromMetrics
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


def test_stats_aggregate_across_ranks_and_reduce_for_the_log_line():
    rank0 = KVOffloadConnector.build_kv_connector_stats(
        {"loaded_bytes": 2e9, "load_seconds": 0.5, "hit_tokens": 300, "queried_tokens": 1000}
    )
    rank1 = ConnectorStats(
        {"loaded_bytes": 2e9, "load_seconds": 0.5, "lookups": 2, "lookup_seconds": 0.004}
    )
    total = rank0.aggregate(rank1)
    r = total.reduce()
    assert r["load_GBps"] == 4.0  # 4 GB in 1 s of copies
    assert r["hit_tokens"] == 300 and r["hit_rate"] == 0.3
    assert r["lookup_ms"] == 2.0
    assert not total.is_empty()
    total.reset()
    assert total.is_empty()


class _Cfg:
    kv_transfer_config = None


def test_prom_metrics_count_per_engine():
    reg = CollectorRegistry()

    def bound(cls):
        return lambda *a, **kw: cls(*a, registry=reg, **kw)

    types = {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}
    prom = PromMetrics(_Cfg(), types, ["engine"], {0: ["0"], 1: ["1"]})
    prom.observe({"hit_tokens": 64, "loaded_bytes": 1024}, engine_idx=0)
    prom.observe({"hit_tokens": 32}, engine_idx=0)
    prom.observe({"hit_tokens": 8}, engine_idx=1)
    assert reg.get_sample_value("kvoffload_connector_hit_tokens_total", {"engine": "0"}) == 96
    assert reg.get_sample_value("kvoffload_connector_hit_tokens_total", {"engine": "1"}) == 8
    assert reg.get_sample_value("kvoffload_connector_loaded_bytes_total", {"engine": "0"}) == 1024
