"""The connector's series on vLLM's /metrics: the last engine of a process owns them, and
`vllm:kvoffload_pool_*` names the pool the engine uses, so readers that gather replicas count a
shared pool once per `pool_id`.

The collectors are made as vLLM makes them (prometheus_client's classes, the default registry
its /metrics serves); the pool's name comes from a real sidecar's Register answer.
"""

from __future__ import annotations

import socket

import msgspec
import pytest
from kvoffload_cli.sidecar_child import SidecarProcess
from kvoffload_connector import owned_metrics
from kvoffload_connector.common.client import PoolClient, RegisterResult
from kvoffload_connector.common.pool_replies import PoolName, RankRegion
from kvoffload_connector.connector import KVOffloadConnector
from kvoffload_connector.scheduler.scheduler_stats import pool_entry
from kvoffload_connector.stats import ConnectorStats, PromMetrics
from prometheus_client import REGISTRY, Counter, Gauge, Histogram, generate_latest
from vllm.v1.metrics.prometheus import unregister_vllm_metrics

from tests.connector.specs import TINY_SPEC
from tests.connector.test_scheduler import FakePool, make

TYPES = {Gauge: Gauge, Counter: Counter, Histogram: Histogram}  # what vLLM hands connectors
ENGINE = {"model_name": "m", "engine": "0"}


class _Cfg:
    kv_transfer_config = None


def engine_metrics() -> PromMetrics:
    """One engine's connector metrics, as vLLM's PrometheusStatLogger builds them at engine
    start (its own sweep of `vllm:` collectors first)."""
    unregister_vllm_metrics()
    return PromMetrics(_Cfg(), TYPES, ["model_name", "engine"], {0: ["m", "0"]})


def entry(pool_id: str, **fields) -> dict:
    return {
        "placement": "node",
        "pool_id": pool_id,
        "node_pool": "np",
        "node": "n1",
        "tenant": "alpha",
        "pool_bytes": 1 << 30,
        "pool_namespace": "ns1",
        "capacity_bytes": 1 << 29,
        "capacity_tokens": 4096,
        **fields,
    }


def value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, {**ENGINE, **labels})


def info_ids() -> set[str]:
    return {
        s.labels["pool_id"]
        for family in REGISTRY.collect()
        if family.name == "vllm:kvoffload_pool_info"
        for s in family.samples
    }


def test_a_second_engine_in_the_process_exports_its_own_numbers_and_the_first_ones_go():
    first = engine_metrics()
    first.observe({"hit_tokens": 10, "stored_bytes": 4096, "pool": entry("np/n1/alpha/g1")})
    assert value("kvoffload_connector_hit_tokens_total") == 10
    assert value("vllm:kv_offload_store_bytes_total") == 4096

    second = engine_metrics()  # the names were the first engine's: they are this one's now
    second.observe({"hit_tokens": 3, "pool": entry("np/n1/alpha/g2")})
    assert value("kvoffload_connector_hit_tokens_total") == 3  # the live engine's, not 13
    assert value("vllm:kv_offload_store_bytes_total") is None  # nothing stored by it yet
    assert value("vllm:kvoffload_pool_active", reason="") == 1
    assert info_ids() == {"np/n1/alpha/g2"}
    first.observe({"hit_tokens": 100})  # the first engine, still counting, is not exported
    assert value("kvoffload_connector_hit_tokens_total") == 3
    text = generate_latest(REGISTRY).decode()
    assert text.count("# TYPE kvoffload_connector_hit_tokens_total counter") == 1


def test_the_pool_series_name_the_pool_and_follow_a_new_one():
    prom = engine_metrics()
    prom.observe({"pool": entry("np/n1/alpha/g1")})
    labels = {"pool_id": "np/n1/alpha/g1"}
    info = {"placement": "node", "node_pool": "np", "node": "n1", "tenant": "alpha", **labels}
    assert value("vllm:kvoffload_pool_info", **info) == 1
    assert value("vllm:kvoffload_pool_size_bytes", **labels) == 1 << 30
    ns = {**labels, "pool_namespace": "ns1"}
    assert value("vllm:kvoffload_pool_capacity_bytes", **ns) == 1 << 29
    assert value("vllm:kvoffload_pool_capacity_tokens", **ns) == 4096
    # the pool rebuilt (another generation): the engine's series name the new one only
    prom.observe({"pool": entry("np/n1/alpha/g2", capacity_tokens=2048)})
    assert info_ids() == {"np/n1/alpha/g2"}
    assert value("vllm:kvoffload_pool_size_bytes", **labels) is None
    ns2 = {"pool_id": "np/n1/alpha/g2", "pool_namespace": "ns1"}
    assert value("vllm:kvoffload_pool_capacity_tokens", **ns2) == 2048


def test_a_name_taken_by_another_collector_costs_that_series_only():
    owned_metrics.take_names()
    foreign = Counter("kvoffload_connector_hit_tokens", "not the connector's", ["x"])
    try:
        prom = engine_metrics()
        prom.observe({"hit_tokens": 5, "loaded_bytes": 7, "pool": entry("p/1")})
        assert value("kvoffload_connector_loaded_bytes_total") == 7
        assert info_ids() == {"p/1"}
    finally:
        REGISTRY.unregister(foreign)


def test_the_pool_rides_the_stats_unsummed_through_vllms_transport():
    scheduler = ConnectorStats()
    scheduler.add({"hit_tokens": 32, "pool": entry("p/1")})
    worker = KVOffloadConnector.build_kv_connector_stats({"loaded_bytes": 100})
    total = worker.aggregate(scheduler).aggregate(ConnectorStats({"hit_tokens": 1}))
    assert total.data["pool"] == entry("p/1") and total.data["hit_tokens"] == 33
    again = total.aggregate(ConnectorStats({"pool": entry("p/2")}))
    assert again.data["pool"]["pool_id"] == "p/2"  # the latest, not a sum
    assert not ConnectorStats({"pool": entry("p/1")}).is_empty()
    assert "pool" not in total.reduce()  # the log line stays numbers
    # the engine core sends stats to the API server as msgpack (vLLM's msgspec encoder)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(total.data))
    prom = engine_metrics()
    prom.observe(wire)
    assert info_ids() == {"p/1"} and value("kvoffload_connector_hit_tokens_total") == 33


def _registration(pool_id: str) -> RegisterResult:
    return RegisterResult(
        namespace_id="ns1",
        client_id=1,
        regions=(RankRegion(0, "", 0, 1000, 8), RankRegion(1, "", 0, 1000, 8)),
        pool_ready=True,
        committed_blocks=0,
        generation="g",
        pool=PoolName("node", pool_id, "np", "n1", "alpha", 1 << 20),
    )


def test_the_scheduler_sends_the_pool_once_per_registration_and_again_now_and_then():
    now = [100.0]
    fake = FakePool()
    s, *_ = make(pool=fake, world=2, clock=lambda: now[0])
    assert s.take_stats().pool == {}  # the fake's registration names no pool
    fake.registration = _registration("np/n1/alpha/g1")
    assert s.stats_pending()  # a new registration is worth a stats message of its own
    sent = s.take_stats().pool
    assert sent["pool_id"] == "np/n1/alpha/g1" and sent["capacity_bytes"] == 8 * 2000
    assert sent["capacity_tokens"] == 8 * s.chunk_tokens
    assert not s.stats_pending()
    s.stats.lookups += 1
    assert s.take_stats().pool == {}  # with counted stats, not again so soon
    now[0] += 31
    s.stats.lookups += 1
    assert s.take_stats().pool["pool_id"] == "np/n1/alpha/g1"  # an engine that lost it
    fake.registration = _registration("np/n1/alpha/g2")  # registered again: a rebuilt pool
    assert s.stats_pending() and s.take_stats().pool["pool_id"] == "np/n1/alpha/g2"


@pytest.mark.process
@pytest.mark.timeout(60)
def test_a_sidecars_register_answer_names_its_pod_pool_as_its_stats_count_it():
    sc = SidecarProcess(pool_size="16Mi")
    sc.start()
    try:
        c = PoolClient(sc.socket, "test/scheduler", rpc_timeout_s=2)
        reg = c.register(TINY_SPEC, 1, 8192)
        st = sc.stats()
        assert reg.pool == PoolName(
            "pod", f"{socket.gethostname()}/{st.pool_generation}", pool_bytes=st.pool_bytes
        )
        (ns,) = st.namespaces
        got = pool_entry(reg, TINY_SPEC.block_size * TINY_SPEC.chunk_blocks, 1)
        assert (got["capacity_bytes"], got["capacity_tokens"]) == (
            ns.capacity_bytes,
            ns.capacity_tokens,
        )
        assert got["pool_namespace"] == ns.namespace_id and got["pool_bytes"] == 16 << 20
        c.close()
    finally:
        sc.close()
    prom = engine_metrics()
    prom.observe({"pool": got})
    labels = {"pool_id": reg.pool.pool_id, "pool_namespace": ns.namespace_id}
    assert value("vllm:kvoffload_pool_capacity_tokens", **labels) == ns.capacity_tokens
    assert info_ids() == {reg.pool.pool_id}
