"""Keep an injected pod's QoS class and pod-level resource budget as the user wrote them (pure).

Why: Kubernetes computes a pod's QoS class over every container, init containers included.
A Guaranteed vLLM pod (every container's CPU and memory limits equal to its requests) keeps its
exclusive cores under the kubelet's static CPU manager and is the last to go under node
pressure; one injected container without a CPU limit would make it Burstable and take both
away. So in a Guaranteed pod the injected containers get limits equal to their requests, the
sidecar one whole CPU (a quota below one CPU would throttle its control path while it
pre-faults the pool) and the installer enough not to crawl through its copy.

A pod with pod-level resources (``spec.resources``) is classed and bounded by those instead,
and the API server rejects a pod whose containers request more than the pod does: the
sidecar's CPU and memory (the pool included) are added to the pod-level requests and limits
that are set, so vLLM's own budget stays what it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from decimal import ROUND_CEILING, Decimal
from typing import Any

from kvoffload_operator.policy import MIB, PolicyError, quantity_value

QOS_RESOURCES = ("cpu", "memory")  # the two Kubernetes classes pods by
GUARANTEED_SIDECAR_CPU = "1"
GUARANTEED_INSTALLER_CPU = "500m"


def _equal(a: Any, b: Any) -> bool:
    try:
        return quantity_value(a) == quantity_value(b)
    except PolicyError:
        return False  # an unreadable quantity is not known to be equal


def _guaranteed(resources: Mapping[str, Any] | None) -> bool:
    limits = (resources or {}).get("limits") or {}
    requests = (resources or {}).get("requests") or {}
    return all(
        r in limits and (r not in requests or _equal(requests[r], limits[r])) for r in QOS_RESOURCES
    )


def pod_level(spec: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The pod-level ``resources`` when they set any request or limit."""
    res = spec.get("resources") or {}
    return res if (res.get("requests") or res.get("limits")) else None


def is_guaranteed(spec: Mapping[str, Any]) -> bool:
    """Whether Kubernetes classes a pod with this spec Guaranteed."""
    level = pod_level(spec)
    if level is not None:
        return _guaranteed(level)
    containers = [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]
    return bool(containers) and all(_guaranteed(c.get("resources")) for c in containers)


def guaranteed_resources(resources: Mapping[str, Any], cpu: str) -> dict[str, Any]:
    """An injected container's resources for a Guaranteed pod: CPU `cpu` unless the policy
    set one, and each CPU and memory limit equal to its request (a missing side copies the
    other)."""
    requests = dict(resources.get("requests") or {})
    limits = dict(resources.get("limits") or {})
    if "cpu" not in requests and "cpu" not in limits:
        requests["cpu"] = cpu
    for r in QOS_RESOURCES:
        if r in requests and r not in limits:
            limits[r] = requests[r]
        elif r in limits and r not in requests:
            requests[r] = limits[r]
    return {"requests": requests, "limits": limits}


def _format(resource: str, value: Decimal) -> str:
    if resource == "cpu":
        return f"{int((value * 1000).to_integral_value(ROUND_CEILING))}m"
    whole = int(value.to_integral_value(ROUND_CEILING))
    return f"{whole // MIB}Mi" if whole % MIB == 0 else str(whole)


def grow_pod_level(spec: dict[str, Any], added: Mapping[str, Any]) -> list[str]:
    """Add an injected long-running container's CPU and memory (`added`, its resources) to
    each pod-level request and limit the pod sets; where the container has no limit, its
    request. Returns the grown keys ("requests.memory", ...). A pod-level quantity that does
    not parse is left alone (the API server will say why)."""
    level = pod_level(spec)
    if level is None:
        return []
    grown = []
    for kind in ("requests", "limits"):
        have = level.get(kind) or {}
        for r in QOS_RESOURCES:
            extra = (added.get(kind) or {}).get(r) or (added.get("requests") or {}).get(r)
            if r not in have or extra is None:
                continue
            try:
                total = quantity_value(have[r]) + quantity_value(extra)
            except PolicyError:
                continue
            have[r] = _format(r, total)
            grown.append(f"{kind}.{r}")
    return grown


def within_limits(resources: dict[str, Any]) -> dict[str, Any]:
    """A computed request above the limit a policy set (e.g. a CPU limit below the default
    250m request) comes down to that limit: the API server refuses a container whose request
    exceeds its limit, and the pod must be created. The policy's own pairs are checked when it
    is read (policy.py)."""
    requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
    for name in set(requests) & set(limits):
        try:
            if quantity_value(requests[name]) > quantity_value(limits[name]):
                requests[name] = limits[name]
        except PolicyError:
            continue  # policy.py rejects unreadable quantities before they get here
    return resources
