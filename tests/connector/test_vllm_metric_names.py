"""The connector's bytes and seconds under vLLM's own `vllm:kv_offload_*` names (what llm-d's
tiered-cache dashboards query), beside kvoffload's names, and never twice in one registry."""

from __future__ import annotations

from kvoffload_connector.stats import PromMetrics
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class _Kv:
    def __init__(self, connector: str, extra: dict) -> None:
        self.kv_connector = connector
        self.kv_connector_extra_config = extra


class _Cfg:
    def __init__(self, kv=None) -> None:
        self.kv_transfer_config = kv


def _prom(cfg) -> tuple[PromMetrics, CollectorRegistry]:
    reg = CollectorRegistry()

    def bound(cls):
        return lambda *a, **kw: cls(*a, registry=reg, **kw)

    types = {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}
    return PromMetrics(cfg, types, ["model_name", "engine"], {0: ["m", "0"]}), reg


def test_vllm_names_count_what_kvoffloads_names_count():
    prom, reg = _prom(_Cfg(_Kv("KVOffloadConnector", {})))
    prom.observe({"stored_bytes": 4096, "loaded_bytes": 1024, "load_seconds": 0.25})
    prom.observe({"stored_bytes": 4096, "store_seconds": 0.5})
    labels = {"model_name": "m", "engine": "0"}
    for ours, vllms, want in (
        ("kvoffload_connector_stored_bytes_total", "vllm:kv_offload_store_bytes_total", 8192),
        ("kvoffload_connector_loaded_bytes_total", "vllm:kv_offload_load_bytes_total", 1024),
        ("kvoffload_connector_load_seconds_total", "vllm:kv_offload_load_time_total", 0.25),
        ("kvoffload_connector_store_seconds_total", "vllm:kv_offload_store_time_total", 0.5),
    ):
        assert reg.get_sample_value(ours, labels) == want, ours
        assert reg.get_sample_value(vllms, labels) == want, vllms


def test_beside_vllms_offloading_connector_its_names_stay_its_own():
    """A MultiConnector with vLLM's OffloadingConnector: that connector registers the
    `vllm:kv_offload_*` names in the same registry; registering them again would raise at
    engine start (rule 1), so kvoffload keeps to its own names there."""
    multi = _Kv(
        "MultiConnector",
        {
            "connectors": [
                {"kv_connector": "KVOffloadConnector"},
                {"kv_connector": "OffloadingConnector"},
            ]
        },
    )
    prom, reg = _prom(_Cfg(multi))
    Counter("vllm:kv_offload_store_bytes", "vLLM's own", ["model_name", "engine"], registry=reg)
    prom.observe({"stored_bytes": 4096})
    labels = {"model_name": "m", "engine": "0"}
    assert reg.get_sample_value("kvoffload_connector_stored_bytes_total", labels) == 4096
    assert reg.get_sample_value("vllm:kv_offload_store_bytes_total", labels) is None
