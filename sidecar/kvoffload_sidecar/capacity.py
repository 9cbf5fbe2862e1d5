"""The pod's effective KV capacity in tokens, per served model: GPU tier plus host tier.

Why: an autoscaler that reads only vLLM's GPU KV cache sees a cache that is always full; with
the host tier the pod holds far more prefixes. The GPU tier is what each engine's connector
wrote in its status file beside the socket (`num_gpu_blocks` x `block_size` / KV groups, see
`kvoffload_connector.capacity`); the host tier is each pool namespace of that model: its slot
count x chunk tokens / KV groups (a slot holds one chunk of one KV group). Dividing by the
groups counts the tokens every group can hold, for both tiers alike (a hybrid model's sliding
window groups keep fewer blocks, so both numbers are lower bounds there).

Only namespaces with a live client count while any namespace of that model has one (an old
namespace a config change left behind is not served); otherwise all of them (an engine between
restarts still owns its blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvoffload_sidecar.connector_status import connector_statuses

if TYPE_CHECKING:
    from kvoffload_sidecar.keys import NamespaceSpec
    from kvoffload_sidecar.pool import NamespaceStats, Pool

KV_GROUPS_KEY = "kv_groups"  # spec.extra key the connector fills, ";"-separated groups
CAPACITY_METRIC = "kvoffload_kv_capacity_tokens"
EFFECTIVE_METRIC = "kvoffload_kv_effective_capacity_tokens"


@dataclass(frozen=True)
class ModelCapacity:
    """KV tokens one served model can keep in this pod, per tier."""

    model: str
    gpu_tokens: int
    host_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.gpu_tokens + self.host_tokens


def kv_groups(spec: NamespaceSpec) -> int:
    """KV groups in a namespace's spec (1 when the connector did not say)."""
    groups = dict(spec.extra).get(KV_GROUPS_KEY, "")
    return max(1, len([g for g in groups.split(";") if g]))


def slots_tokens(spec: NamespaceSpec, slots: int) -> int:
    """Tokens `slots` slots of a namespace of `spec` hold: slots x chunk tokens / KV groups,
    in that namespace's own block size."""
    return slots * spec.chunk_blocks * spec.block_size // kv_groups(spec)


def host_tokens(ns: NamespaceStats) -> int:
    """Tokens the namespace's slots hold: slots x chunk tokens / KV groups."""
    return slots_tokens(ns.spec, ns.slot_count)


def used_tokens(ns: NamespaceStats) -> int:
    """Tokens of the namespace's committed or reserved slots, counted as `host_tokens`."""
    return slots_tokens(ns.spec, ns.committed_slots + ns.reserved_slots)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def gpu_tokens_by_model(entries: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """GPU-tier tokens per model from the connectors' status entries: the scheduler's entry of
    each engine says it (workers do not); entries without the fields are skipped."""
    out: dict[str, int] = {}
    for entry in entries:
        model = entry.get("model")
        tokens = _int(entry.get("gpu_kv_tokens"))
        if entry.get("role") != "scheduler" or not isinstance(model, str) or not model:
            continue
        if tokens:
            out[model] = out.get(model, 0) + tokens
    return out


def model_capacities(
    namespaces: Sequence[NamespaceStats], entries: Iterable[Mapping[str, Any]]
) -> list[ModelCapacity]:
    """One `ModelCapacity` per model with a pool namespace or a connector entry, by name."""
    gpu = gpu_tokens_by_model(entries)
    by_model: dict[str, list[NamespaceStats]] = {}
    for ns in namespaces:
        by_model.setdefault(ns.spec.model, []).append(ns)
    out = []
    for model in sorted(set(gpu) | set(by_model)):
        spaces = by_model.get(model, [])
        served = [ns for ns in spaces if ns.live_clients > 0] or spaces
        out.append(ModelCapacity(model, gpu.get(model, 0), sum(map(host_tokens, served))))
    return out


class CapacityCollector(Collector):
    """`kvoffload_kv_capacity_tokens{model,tier}` and `..._effective_...{model}` per scrape
    (one `Pool.stats()` and one read of the status files)."""

    def __init__(self, pool: Pool | None, status_dir: Callable[[], Path | None]) -> None:
        self._pool = pool
        self._status_dir = status_dir

    def collect(self) -> Iterator[Metric]:
        namespaces = self._pool.stats().namespaces if self._pool is not None else ()
        capacities = model_capacities(namespaces, connector_statuses(self._status_dir()))
        tiers = GaugeMetricFamily(
            CAPACITY_METRIC,
            "KV tokens the pod can keep for a served model, per tier: gpu (vLLM's KV cache, "
            "num_gpu_blocks x block_size / KV groups, from the connector) and host (the pool "
            "namespaces' slots x chunk tokens / KV groups).",
            labels=["model", "tier"],
        )
        total = GaugeMetricFamily(
            EFFECTIVE_METRIC,
            "KV tokens the pod can keep for a served model, GPU and host tiers together.",
            labels=["model"],
        )
        for c in capacities:
            tiers.add_metric([c.model, "gpu"], float(c.gpu_tokens))
            tiers.add_metric([c.model, "host"], float(c.host_tokens))
            total.add_metric([c.model], float(c.total_tokens))
        yield tiers
        yield total
