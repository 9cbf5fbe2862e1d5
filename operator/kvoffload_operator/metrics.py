"""The operator's Prometheus metrics, declared as data on one registry per process (or test)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Admission must finish well inside the webhook's timeoutSeconds (5 s in the chart).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass(frozen=True)
class OperatorMetrics:
    registry: CollectorRegistry
    injections: Counter  # kvoffload_injections_total{outcome=injected|skipped|error, reason}
    injection_seconds: Histogram  # kvoffload_injection_duration_seconds
    reconciles: Counter  # kvoffload_policy_reconciles_total{result=success|error}
    rollouts: Counter  # kvoffload_rollouts_total{kind}
    build_info: Gauge  # kvoffload_operator_build_info{version} = 1

    @classmethod
    def create(
        cls, registry: CollectorRegistry | None = None, version: str = "0.1.0"
    ) -> OperatorMetrics:
        reg = registry if registry is not None else CollectorRegistry()
        info = Gauge(
            "kvoffload_operator_build_info", "Operator version.", ["version"], registry=reg
        )
        info.labels(version=version).set(1)
        return cls(
            registry=reg,
            injections=Counter(
                "kvoffload_injections",
                "Pods seen by the injection webhook.",
                ["outcome", "reason"],
                registry=reg,
            ),
            injection_seconds=Histogram(
                "kvoffload_injection_duration_seconds",
                "Time to answer one admission request.",
                buckets=LATENCY_BUCKETS,
                registry=reg,
            ),
            reconciles=Counter(
                "kvoffload_policy_reconciles", "Policy reconciliations.", ["result"], registry=reg
            ),
            rollouts=Counter(
                "kvoffload_rollouts",
                "Workload templates stamped with a new policy hash.",
                ["kind"],
                registry=reg,
            ),
            build_info=info,
        )
