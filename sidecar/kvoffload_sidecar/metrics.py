"""Prometheus metrics and RPC latency for one sidecar, declared as a table.

Pool gauges and counters are read from `Pool.stats()` at scrape time by `PoolCollector` (nothing
on the RPC hot path); the RPC duration histogram, the recent-latency rings and the store/load
latency histograms (`transfer_timing`) are the only things updated per call. The pod's KV
capacity in tokens per model (GPU + host tier) comes from `capacity`. Each `SidecarMetrics`
owns a private `CollectorRegistry`, so tests and several servers in one process never share
state. docs/METRICS.md lists every series (tests/sidecar/test_metrics_exposition.py checks it
against a real sidecar's /metrics).

Per-namespace series are labelled `pool_namespace` (the pool's namespace id), never `namespace`:
that name is the Kubernetes target label a PodMonitor adds, and Prometheus would rename ours to
`exported_namespace`.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram, Info, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvoffload_sidecar import persist
from kvoffload_sidecar.capacity import CapacityCollector, host_tokens, used_tokens
from kvoffload_sidecar.persist import Adoption
from kvoffload_sidecar.tenant_metrics import tenant_metrics
from kvoffload_sidecar.transfer_timing import TransferTimer

if TYPE_CHECKING:
    from kvoffload_sidecar.pool import NamespaceStats, Pool, PoolStats

RPC_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.5, 1.0, 5.0)
LATENCY_WINDOW = 4096  # recent calls per method kept for the Stats RPC's p50/p99
NAMESPACE_LABEL = "pool_namespace"  # not `namespace`: Kubernetes scrapes own that label


def package_version() -> str:
    try:
        return metadata.version("kvoffload")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0+unknown"


Samples = Callable[["NamespaceStats", "PoolStats"], Iterable[tuple[tuple[str, ...], float]]]


@dataclass(frozen=True)
class NamespaceMetric:
    """One per-namespace metric read from PoolStats; labels start with `pool_namespace`."""

    name: str  # counters without the `_total` suffix: client_python adds it
    kind: str  # "gauge" | "counter"
    help: str
    labels: tuple[str, ...]
    samples: Samples  # extra label values (after pool_namespace) and value


def _one(field: str) -> Samples:
    return lambda ns, _pool: (((), float(getattr(ns, field))),)


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


NAMESPACE_METRICS: tuple[NamespaceMetric, ...] = (
    NamespaceMetric(
        "kvoffload_pool_capacity_bytes",
        "gauge",
        "Bytes of the namespace's partition usable for slots.",
        (NAMESPACE_LABEL,),
        _one("capacity_bytes"),
    ),
    NamespaceMetric(
        "kvoffload_pool_used_bytes",
        "gauge",
        "Bytes in committed or reserved slots.",
        (NAMESPACE_LABEL,),
        _one("used_bytes"),
    ),
    NamespaceMetric(
        "kvoffload_pool_capacity_blocks",
        "gauge",
        "Slots of the namespace's partition (one block: a chunk of chunk_blocks GPU blocks, "
        "every rank).",
        (NAMESPACE_LABEL,),
        _one("slot_count"),
    ),
    NamespaceMetric(
        "kvoffload_pool_used_blocks",
        "gauge",
        "Slots committed or reserved.",
        (NAMESPACE_LABEL,),
        lambda ns, _p: (((), float(ns.committed_slots + ns.reserved_slots)),),
    ),
    NamespaceMetric(
        "kvoffload_pool_usage_perc",
        "gauge",
        "Fraction of the namespace's slots committed or reserved (0 to 1, like "
        "vllm:kv_cache_usage_perc).",
        (NAMESPACE_LABEL,),
        lambda ns, _p: (((), _ratio(ns.committed_slots + ns.reserved_slots, ns.slot_count)),),
    ),
    NamespaceMetric(
        "kvoffload_pool_capacity_tokens",
        "gauge",
        "Tokens the namespace's slots hold: slots x chunk tokens / KV groups (host tier).",
        (NAMESPACE_LABEL,),
        lambda ns, _p: (((), float(host_tokens(ns))),),
    ),
    NamespaceMetric(
        "kvoffload_pool_used_tokens",
        "gauge",
        "Tokens of the namespace's committed or reserved slots, counted as capacity_tokens.",
        (NAMESPACE_LABEL,),
        lambda ns, _p: (((), float(used_tokens(ns))),),
    ),
    NamespaceMetric(
        "kvoffload_pool_pinned_bytes",
        "gauge",
        "Bytes in slots pinned by loads.",
        (NAMESPACE_LABEL,),
        _one("pinned_bytes"),
    ),
    NamespaceMetric(
        "kvoffload_live_clients",
        "gauge",
        "Registered clients not yet detached or reaped.",
        (NAMESPACE_LABEL,),
        _one("live_clients"),
    ),
    NamespaceMetric(
        "kvoffload_lookups",
        "counter",
        "Lookup queries (one per key list).",
        (NAMESPACE_LABEL,),
        _one("lookups"),
    ),
    NamespaceMetric(
        "kvoffload_lookup_blocks",
        "counter",
        "Keys found by lookups (hit) and first missing key of each query that missed (miss).",
        (NAMESPACE_LABEL, "result"),
        lambda ns, _p: ((("hit",), float(ns.hit_blocks)), (("miss",), float(ns.miss_blocks))),
    ),
    NamespaceMetric(
        "kvoffload_lookup_queried_blocks",
        "counter",
        "Keys asked by lookups (the hit rate: lookup_blocks with result hit over this).",
        (NAMESPACE_LABEL,),
        _one("queried_blocks"),
    ),
    NamespaceMetric(
        "kvoffload_stored_blocks",
        "counter",
        "Slots committed by every rank.",
        (NAMESPACE_LABEL,),
        _one("stored_blocks"),
    ),
    NamespaceMetric(
        "kvoffload_loaded_blocks",
        "counter",
        "Slots pinned for loading (the connector pins a request's whole hit prefix, chunks "
        "its GPU still holds included, and copies only the rest).",
        (NAMESPACE_LABEL,),
        _one("loaded_blocks"),
    ),
    NamespaceMetric(
        "kvoffload_evicted_blocks",
        "counter",
        "Committed slots evicted to make room.",
        (NAMESPACE_LABEL, "policy"),
        lambda ns, pool: (((pool.eviction_policy,), float(ns.evicted_blocks)),),
    ),
    NamespaceMetric(
        "kvoffload_stored_bytes",
        "counter",
        "Bytes of slots committed (all ranks).",
        (NAMESPACE_LABEL,),
        _one("stored_bytes"),
    ),
    NamespaceMetric(
        "kvoffload_loaded_bytes",
        "counter",
        "Bytes of slots pinned for loading, all ranks (whole hit prefixes: more than the "
        "bytes copied when the GPU still holds part of a prefix).",
        (NAMESPACE_LABEL,),
        _one("loaded_bytes"),
    ),
)


def _adoption_metrics(adoption: Adoption, generation: str) -> Iterator[Metric]:
    """What this sidecar's start found in the pool file: kept, discarded and why, how long."""
    info = GaugeMetricFamily(
        "kvoffload_pool_info",
        "The pool file this sidecar serves (value 1): generation (kept across restarts that "
        "adopt the file), format version, and what the start did with the file found.",
        labels=["generation", "format_version", "outcome"],
    )
    info.add_metric([generation, str(persist.FORMAT_VERSION), adoption.outcome], 1.0)
    adopted = GaugeMetricFamily(
        "kvoffload_pool_adopted_blocks",
        "Committed blocks this sidecar adopted from the pool file at start.",
    )
    adopted.add_metric([], float(adoption.adopted_blocks))
    discarded = GaugeMetricFamily(
        "kvoffload_pool_discarded_blocks",
        "Records of the pool file not adopted at start, per reason (torn, reserved, duplicate; "
        "namespace counts unreadable namespace records).",
        labels=["reason"],
    )
    for reason, n in sorted(adoption.discarded.items()):
        discarded.add_metric([reason], float(n))
    seconds = GaugeMetricFamily(
        "kvoffload_pool_adoption_seconds",
        "Seconds this sidecar spent reading the pool file's index at start.",
    )
    seconds.add_metric([], adoption.seconds)
    boots = GaugeMetricFamily(
        "kvoffload_pool_boots",
        "Sidecar processes that have served this pool file, this one included.",
    )
    boots.add_metric([], float(adoption.boots))
    yield from (info, adopted, discarded, seconds, boots)


class PoolCollector(Collector):
    """Reads one `Pool.stats()` per scrape and yields every table metric from it."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        stats = self._pool.stats()
        size = GaugeMetricFamily(
            "kvoffload_pool_size_bytes", "Bytes of the pool file (all namespaces)."
        )
        size.add_metric([], float(stats.pool_bytes))
        prefaulted = GaugeMetricFamily(
            "kvoffload_pool_prefaulted_bytes",
            "Bytes of the pool file already pre-faulted (all namespaces).",
        )
        prefaulted.add_metric([], float(stats.prefaulted_bytes))
        ready = GaugeMetricFamily("kvoffload_pool_ready", "1 once the whole pool is pre-faulted.")
        ready.add_metric([], 1.0 if stats.pool_ready else 0.0)
        rebuilds = CounterMetricFamily(
            "kvoffload_pool_rebuilds",
            "Times the pool file was truncated, removed or replaced under the sidecar and rebuilt.",
        )
        rebuilds.add_metric([], float(self._pool.rebuilds))
        yield from (size, prefaulted, ready, rebuilds)
        yield from _adoption_metrics(stats.adoption, stats.pool_generation)
        spec_info = GaugeMetricFamily(
            "kvoffload_namespace_info",
            "Spec of each namespace (value 1).",
            labels=[
                NAMESPACE_LABEL,
                "model",
                "dtype",
                "kv_layout",
                "block_size",
                "chunk_blocks",
                "tp_size",
            ],
        )
        for ns in stats.namespaces:
            spec = ns.spec
            spec_info.add_metric(
                [
                    ns.namespace_id,
                    spec.model,
                    spec.dtype,
                    spec.kv_layout,
                    str(spec.block_size),
                    str(spec.chunk_blocks),
                    str(spec.tp_size),
                ],
                1.0,
            )
        yield spec_info
        for spec_ in NAMESPACE_METRICS:
            family_type = GaugeMetricFamily if spec_.kind == "gauge" else CounterMetricFamily
            family = family_type(spec_.name, spec_.help, labels=list(spec_.labels))
            for ns in stats.namespaces:
                for extra, value in spec_.samples(ns, stats):
                    family.add_metric([ns.namespace_id, *extra], value)
            yield family
        yield from tenant_metrics(stats, NAMESPACE_LABEL)  # per-tenant quotas (--tenants)


@dataclass(frozen=True)
class MethodLatency:
    """Recent latency of one RPC method: calls since start, p50/p99 over the recent window."""

    method: str
    count: int
    p50_seconds: float
    p99_seconds: float


class LatencyRecorder:
    """Bounded ring of recent call durations per method (an O(1) append and a counted lock).

    `deque.append` with a maxlen is atomic under the GIL, so the asyncio loop and a scrape thread
    may touch it concurrently; `snapshot` copies before sorting.
    """

    def __init__(self, window: int = LATENCY_WINDOW) -> None:
        self._window = window
        self._recent: dict[str, deque[float]] = {}
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()  # creating a method's ring; its count

    def ring(self, method: str) -> deque[float]:
        ring = self._recent.get(method)
        if ring is None:
            with self._lock:
                ring = self._recent.setdefault(method, deque(maxlen=self._window))
                self._counts.setdefault(method, 0)
        return ring

    def observe(self, method: str, seconds: float) -> None:
        self.ring(method).append(seconds)
        with self._lock:  # framed sessions observe from their own threads
            self._counts[method] += 1

    def snapshot(self) -> tuple[MethodLatency, ...]:
        result = []
        for method in sorted(self._recent):
            values = sorted(self._recent[method])
            if not values:
                continue
            result.append(
                MethodLatency(
                    method, self._counts[method], _quantile(values, 0.50), _quantile(values, 0.99)
                )
            )
        return tuple(result)


def _quantile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank quantile of an already sorted, non-empty list."""
    index = min(len(sorted_values) - 1, max(0, int(q * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


class DegradedCollector(Collector):
    """`kvoffload_pool_degraded{reason}`: 1 with the reason code while serving without a pool,
    `{reason=""} 0` when healthy, so an alert can fire on the value alone."""

    def __init__(self, reason_code: str) -> None:
        self.reason_code = reason_code

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            "kvoffload_pool_degraded",
            "1 while the sidecar serves without a pool (it could not build one), by reason.",
            labels=["reason"],
        )
        gauge.add_metric([self.reason_code], 1.0 if self.reason_code else 0.0)
        yield gauge


class SidecarMetrics:
    """Registry, RPC histogram, latency rings and build info of one server instance."""

    def __init__(
        self,
        pool: Pool | None,
        *,
        build_labels: dict[str, str] | None = None,
        degraded_code: str = "",
        status_dir: Path | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.latency = LatencyRecorder()
        self.status_dir = status_dir  # the connectors' status files (GPU tier capacity)
        self.transfers = TransferTimer(self.registry, NAMESPACE_LABEL)
        self._rpc = Histogram(
            "kvoffload_rpc_duration_seconds",
            "Server-side duration of KVPool calls (unary and in-session), by method.",
            ["method"],
            buckets=RPC_BUCKETS,
            registry=self.registry,
        )
        self._children: dict[str, Any] = {}
        build = Info("kvoffload_build", "Version of the running sidecar.", registry=self.registry)
        build.info({"version": package_version(), **(build_labels or {})})
        self.registry.register(DegradedCollector(degraded_code))
        if pool is not None:
            self.registry.register(PoolCollector(pool))
        self.registry.register(CapacityCollector(pool, lambda: self.status_dir))

    def observe(self, method: str, seconds: float) -> None:
        """Record one call (hot path: a dict lookup, a deque append, a histogram observe)."""
        child = self._children.get(method)
        if child is None:
            child = self._children.setdefault(method, self._rpc.labels(method))
        child.observe(seconds)
        self.latency.observe(method, seconds)

    def serve_http(self, address: str) -> MetricsHttpServer:
        """Start /metrics on HOST:PORT in a daemon thread (port 0 picks a free port)."""
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        httpd, thread = start_http_server(int(port), addr=host, registry=self.registry)
        return MetricsHttpServer(httpd, thread)


class MetricsHttpServer:
    """The running /metrics endpoint; `port` is the bound port, `close()` stops it."""

    def __init__(self, httpd: Any, thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread
        self.port: int = httpd.server_address[1]

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
