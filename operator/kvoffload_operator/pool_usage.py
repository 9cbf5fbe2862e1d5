"""A policy's host-memory pool, summed over its injected pods' sidecars (pure).

Why: ``kubectl get kvop`` should say how much pool a policy provisioned and how much of it holds
KV blocks, without a Prometheus. Each sidecar that answered ``Stats`` adds its pool file's size
(``pool_bytes``: what ``spec.pool.size`` gave the pod) and the bytes its namespaces hold
(committed or reserved slots). A sidecar without a pool adds nothing; one that did not answer
is not counted (``unreachableSidecars`` says how many).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvoffload_operator.sidecar_reports import SidecarReport

_BINARY_UNITS = (("Ei", 1 << 60), ("Pi", 1 << 50), ("Ti", 1 << 40), ("Gi", 1 << 30),
                 ("Mi", 1 << 20), ("Ki", 1 << 10))  # fmt: skip


@dataclass(frozen=True)
class PoolUsage:
    capacity_bytes: int
    used_bytes: int

    def status(self) -> dict[str, Any]:
        """The policy status fields: integers for tools, binary-SI strings for the columns."""
        return {
            "poolCapacityBytes": self.capacity_bytes,
            "poolUsedBytes": self.used_bytes,
            "poolCapacity": binary_quantity(self.capacity_bytes),
            "poolUsed": binary_quantity(self.used_bytes),
        }


def pool_usage(reports: Iterable[SidecarReport]) -> PoolUsage:
    """Capacity and use over the sidecars that answered."""
    answered = [r for r in reports if r.reachable]
    return PoolUsage(
        sum(max(0, r.pool_bytes) for r in answered), sum(max(0, r.used_bytes) for r in answered)
    )


def binary_quantity(n: int) -> str:
    """Bytes as a Kubernetes-style binary quantity for reading: ``64Gi``, ``1.5Gi``, ``812Ki``,
    ``0``; one decimal at most (rounded), the largest unit that keeps the number >= 1."""
    if n < 1024:
        return str(max(0, n))
    for unit, size in _BINARY_UNITS:
        if n >= size:
            value = round(n / size, 1)
            text = f"{value:.1f}".removesuffix(".0")
            return f"{text}{unit}"
    raise AssertionError("unreachable: n >= 1024 has a unit")  # pragma: no cover
