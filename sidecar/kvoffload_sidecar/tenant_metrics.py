"""Prometheus series of per-tenant quotas (`--tenants`), read from `Pool.stats()` at scrape.

Labelled by namespace and `tenant`; the tenant label takes only configured names and
`default` (every request without a salt, or with one no tenant names), so its cardinality is
bounded by the flag, never by the traffic. Without `--tenants` there are no series.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from kvoffload_sidecar.pool import PoolStats
    from kvoffload_sidecar.tenants import TenantStats

TENANT_LABEL = "tenant"

# (name, kind, help, value); counters without `_total` (client_python adds it)
_SERIES: tuple[tuple[str, str, str, Callable[[TenantStats], float]], ...] = (
    (
        "kvoffload_tenant_guaranteed_blocks",
        "gauge",
        "Slots of the namespace no other tenant's stores can push the tenant below.",
        lambda t: t.guaranteed_slots,
    ),
    (
        "kvoffload_tenant_max_blocks",
        "gauge",
        "Slots the tenant may fill at most (at it, it replaces only its own blocks).",
        lambda t: t.max_slots,
    ),
    (
        "kvoffload_tenant_used_blocks",
        "gauge",
        "Slots the tenant's blocks hold, committed or reserved.",
        lambda t: t.used_slots,
    ),
    (
        "kvoffload_tenant_used_bytes",
        "gauge",
        "Bytes of the tenant's committed or reserved slots (all ranks).",
        lambda t: t.used_bytes,
    ),
    (
        "kvoffload_tenant_stored_blocks",
        "counter",
        "The tenant's slots committed by every rank.",
        lambda t: t.stored_blocks,
    ),
    (
        "kvoffload_tenant_evicted_blocks",
        "counter",
        "The tenant's committed slots evicted to make room.",
        lambda t: t.evicted_blocks,
    ),
    (
        "kvoffload_tenant_lookups",
        "counter",
        "Lookup queries of the tenant's requests (one per key list).",
        lambda t: t.lookups,
    ),
    (
        "kvoffload_tenant_lookup_queried_blocks",
        "counter",
        "Keys the tenant's lookups asked (its hit rate: tenant_lookup_blocks hit over this).",
        lambda t: t.queried_blocks,
    ),
)


def tenant_metrics(stats: PoolStats, namespace_label: str) -> Iterator[Metric]:
    """Every per-tenant family, one sample per namespace and tenant (none without tenants)."""
    rows = [(ns.namespace_id, t) for ns in stats.namespaces for t in ns.tenants]
    if not rows:
        return
    labels = [namespace_label, TENANT_LABEL]
    for name, kind, help_, value in _SERIES:
        family_type = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
        family = family_type(name, help_, labels=labels)
        for namespace_id, t in rows:
            family.add_metric([namespace_id, t.name], float(value(t)))
        yield family
    blocks = CounterMetricFamily(
        "kvoffload_tenant_lookup_blocks",
        "Keys the tenant's lookups found (hit) and first missing key of each query that "
        "missed (miss).",
        labels=[*labels, "result"],
    )
    for namespace_id, t in rows:
        blocks.add_metric([namespace_id, t.name, "hit"], float(t.hit_blocks))
        blocks.add_metric([namespace_id, t.name, "miss"], float(t.miss_blocks))
    yield blocks
