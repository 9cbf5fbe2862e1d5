"""The node agent's /metrics (`--metrics-listen`): every tenant pool once, named as shared.

In node placement the pods have no sidecar to scrape; the agent holds every tenant's Pool, so
its endpoint is where the pools are seen, each once per node whatever the number of replicas
attached to it. Two kinds of series (docs/METRICS.md, "Node agent"):

- `kvoffload_node_pool_*`, one series per tenant pool, labelled `pool_id` (`<node pool>/<node>/
  <tenant>/<generation>`, the `SharedPool.pool_id` every attached pod's Stats answers): which
  pool it is (`..._info` with node pool, node and tenant), its memory and use in bytes, and who
  shares it (pods attached, pods with a live client, live clients).
- every series a sidecar exposes for its pool (its pool-wide and per-namespace series, the
  store/load latency and RPC histograms, the cache_salt quotas), each tenant's with `pool_id`
  added: per-namespace capacity in tokens is `kvoffload_pool_capacity_tokens{pool_id,
  pool_namespace}`. The per-model capacity series of a pod (`kvoffload_kv_*`: the pod's GPU
  tier plus its host tier) are not exposed here: the agent knows no pod's GPU tier.

Read at scrape time from each Pool (`Pool.stats()`), nothing on the RPC path.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Info
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvoffload_sidecar.capacity import CAPACITY_METRIC, EFFECTIVE_METRIC
from kvoffload_sidecar.metrics import MetricsHttpServer, package_version

if TYPE_CHECKING:
    from kvoffload_sidecar.node.pools import SharedPool, TenantPools

POOL_ID = "pool_id"
# a sidecar's series the agent does not repeat per tenant pool (one build info for the agent;
# no degraded pool: a tenant without a pool has none; no pod's GPU tier)
_NOT_PER_POOL = {"kvoffload_build", "kvoffload_pool_degraded", CAPACITY_METRIC, EFFECTIVE_METRIC}

_SHARED_GAUGES = (
    ("kvoffload_node_pool_capacity_bytes", "capacity_bytes", "Bytes of the tenant's memory."),
    (
        "kvoffload_node_pool_used_bytes",
        "used_bytes",
        "Bytes in committed or reserved slots, every namespace of the pool.",
    ),
    (
        "kvoffload_node_pool_attached_pods",
        "attached_pods",
        "Pods whose pool.sock serves this pool now (published with the tenant's grant).",
    ),
    (
        "kvoffload_node_pool_active_pods",
        "active_pods",
        "Of those, pods with a live client (engine process) registered through their pool.sock.",
    ),
    (
        "kvoffload_node_pool_live_clients",
        "live_clients",
        "Registered clients alive now, every pod and namespace of the pool.",
    ),
)


class NodePoolsCollector(Collector):
    """One scrape: each tenant pool's `SharedPool` and its sidecar series with `pool_id`."""

    def __init__(self, pools: TenantPools) -> None:
        self._pools = pools

    def collect(self) -> Iterator[Metric]:
        shared: list[SharedPool] = []
        merged: dict[str, Metric] = {}
        for tenant in self._pools.tenants():
            info = self._pools.shared(tenant)
            metrics = self._pools.metrics_of(tenant)
            if info is None or metrics is None:
                continue  # closed between the two calls
            shared.append(info)
            for family in metrics.registry.collect():
                if family.name in _NOT_PER_POOL:
                    continue
                out = merged.get(family.name)
                if out is None:
                    out = merged[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                for s in family.samples:
                    out.add_sample(
                        s.name, {POOL_ID: info.pool_id, **s.labels}, s.value, s.timestamp
                    )
        yield from self._shared_families(shared)
        yield from merged.values()

    @staticmethod
    def _shared_families(shared: list[SharedPool]) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "kvoffload_node_pool_info",
            "A tenant pool of this node agent (value 1): the node pool, node and tenant it is; "
            "pool_id is what each attached pod's Stats names (count capacity once per pool_id).",
            labels=[POOL_ID, "node_pool", "node", "tenant", "generation"],
        )
        for p in shared:
            info.add_metric([p.pool_id, p.node_pool, p.node, p.tenant, p.generation], 1.0)
        yield info
        for name, field, help_text in _SHARED_GAUGES:
            family = GaugeMetricFamily(name, help_text, labels=[POOL_ID])
            for p in shared:
                family.add_metric([p.pool_id], float(getattr(p, field)))
            yield family


def serve_metrics(pools: TenantPools, address: str) -> MetricsHttpServer:
    """The agent's /metrics on HOST:PORT (port 0: a free one), in a daemon thread."""
    from prometheus_client import start_http_server

    registry = CollectorRegistry(auto_describe=False)
    Info("kvoffload_build", "Version of the running node agent.", registry=registry).info(
        {"version": package_version()}
    )
    registry.register(NodePoolsCollector(pools))
    host, _, port = address.rpartition(":")
    httpd, thread = start_http_server(int(port), addr=host.strip("[]"), registry=registry)
    return MetricsHttpServer(httpd, thread)
