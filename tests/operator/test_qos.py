"""Injection keeps a pod's QoS class and its pod-level resource budget (inject/qos.py)."""

from __future__ import annotations

import copy
import json
import re
from decimal import Decimal
from typing import Any

import kubernetes_validate
import pytest
from kvoffload_operator import annotations as ann
from kvoffload_operator.inject import inject_pod
from kvoffload_operator.inject.qos import grow_pod_level, is_guaranteed
from kvoffload_operator.policy import PolicyError, policy_from_resource, quantity_value


def policy(**spec: Any) -> Any:
    return policy_from_resource(
        {
            "kind": "KVOffloadPolicy",
            "metadata": {"name": "p"},
            "spec": {
                "selector": {},
                "pool": {"size": "8Gi"},
                "connector": {"delivery": "initContainer"},
                **spec,
            },
        }
    )


def vllm_pod(resources: dict[str, Any] | None, pod_resources: dict | None = None) -> dict:
    engine: dict[str, Any] = {"name": "engine", "image": "img", "command": ["vllm", "serve", "m"]}
    if resources is not None:
        engine["resources"] = resources
    spec: dict[str, Any] = {"containers": [engine]}
    if pod_resources is not None:
        spec["resources"] = pod_resources
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}, "spec": spec}


GUARANTEED = {
    "requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "1"},
    "limits": {"cpu": "8000m", "memory": "65536Mi", "nvidia.com/gpu": "1"},
}


def qty(x: Any) -> Decimal:
    return quantity_value(x)


def assert_guaranteed_by_every_container(spec: dict[str, Any]) -> None:
    """Kubernetes' rule, written out: every container, init containers included, has CPU and
    memory limits, and its requests (where written) equal them."""
    for c in [*spec["containers"], *spec["initContainers"]]:
        res = c.get("resources") or {}
        for r in ("cpu", "memory"):
            assert r in res.get("limits", {}), (c["name"], r)
            assert qty(res["requests"][r]) == qty(res["limits"][r]), (c["name"], r)


def test_a_guaranteed_pod_stays_guaranteed_and_the_sidecar_gets_a_whole_cpu() -> None:
    before = vllm_pod(GUARANTEED)
    assert is_guaranteed(before["spec"])  # "8" and "8000m", "64Gi" and "65536Mi" are equal
    out = inject_pod(copy.deepcopy(before), [policy()]).pod
    spec = out["spec"]
    assert_guaranteed_by_every_container(spec)
    assert is_guaranteed(spec)
    sidecar, installer = spec["initContainers"][1], spec["initContainers"][0]
    assert sidecar["resources"]["limits"]["cpu"] == "1"  # no throttled quota below one CPU
    assert qty(sidecar["resources"]["limits"]["memory"]) > 8 << 30  # the pool is in it
    assert installer["resources"]["limits"] == {"cpu": "500m", "memory": "256Mi"}
    assert spec["containers"][0]["resources"] == GUARANTEED  # the user's own: untouched
    status = json.loads(out["metadata"]["annotations"][ann.STATUS])
    assert status["qos"] == "Guaranteed" and "podResources" not in status
    kubernetes_validate.validate(out, "1.33.0", strict=True)


def test_limits_alone_count_as_guaranteed_and_the_policys_cpu_wins() -> None:
    only_limits = {"limits": {"cpu": "4", "memory": "16Gi"}}
    assert is_guaranteed(vllm_pod(only_limits)["spec"])
    p = policy(sidecar={"resources": {"requests": {"cpu": "2"}}})
    spec = inject_pod(vllm_pod(only_limits), [p]).pod["spec"]
    assert spec["initContainers"][1]["resources"]["limits"]["cpu"] == "2"
    assert spec["initContainers"][1]["resources"]["requests"]["cpu"] == "2"


@pytest.mark.parametrize(
    "resources",
    [
        None,  # BestEffort
        {"requests": {"cpu": "8", "memory": "64Gi"}},  # Burstable: no limits
        {"requests": {"cpu": "4", "memory": "64Gi"}, "limits": {"cpu": "8", "memory": "64Gi"}},
        {"limits": {"memory": "64Gi"}},  # no CPU limit
        {"requests": {"cpu": "x"}, "limits": {"cpu": "x", "memory": "1Gi"}},  # unreadable
    ],
)
def test_other_pods_are_not_guaranteed_and_the_sidecar_keeps_no_cpu_limit(
    resources: dict[str, Any] | None,
) -> None:
    before = vllm_pod(resources)
    assert not is_guaranteed(before["spec"])
    out = inject_pod(before, [policy()]).pod
    sidecar = out["spec"]["initContainers"][1]
    assert "cpu" not in sidecar["resources"]["limits"]
    assert sidecar["resources"]["requests"]["cpu"] == "250m"
    assert "qos" not in json.loads(out["metadata"]["annotations"][ann.STATUS])


def test_pod_level_resources_grow_by_the_sidecars_share() -> None:
    pod_level = {
        "requests": {"cpu": "8", "memory": "64Gi"},
        "limits": {"cpu": "8", "memory": "64Gi"},
    }
    before = vllm_pod({}, pod_level)
    assert is_guaranteed(before["spec"])  # the pod-level budget classes it, not containers
    out = inject_pod(copy.deepcopy(before), [policy()]).pod
    spec = out["spec"]
    sidecar = spec["initContainers"][1]["resources"]
    for kind in ("requests", "limits"):
        for r in ("cpu", "memory"):
            grown = qty(spec["resources"][kind][r])
            assert grown == qty(pod_level[kind][r]) + qty(sidecar[kind][r]), (kind, r)
    # the API server's rule: what the long-running containers request fits the pod's request
    assert qty(spec["resources"]["requests"]["memory"]) >= qty(sidecar["requests"]["memory"])
    assert is_guaranteed(spec)
    kubernetes_validate.validate(out, "1.34.0", strict=True)  # pod-level resources: beta there
    status = json.loads(out["metadata"]["annotations"][ann.STATUS])
    assert sorted(status["podResources"]) == [
        "limits.cpu",
        "limits.memory",
        "requests.cpu",
        "requests.memory",
    ]


def test_pod_level_requests_alone_grow_by_the_request_and_bad_values_are_left() -> None:
    spec: dict[str, Any] = {"resources": {"requests": {"cpu": "2", "memory": "bad"}}}
    added = {"requests": {"cpu": "250m", "memory": "1Gi"}, "limits": {"memory": "1Gi"}}
    assert grow_pod_level(spec, added) == ["requests.cpu"]
    assert spec["resources"] == {"requests": {"cpu": "2250m", "memory": "bad"}}
    limits_only: dict[str, Any] = {"resources": {"limits": {"cpu": "1", "memory": "1Gi"}}}
    # no CPU limit on the sidecar: the pod's CPU limit grows by its request
    assert grow_pod_level(limits_only, added) == ["limits.cpu", "limits.memory"]
    assert limits_only["resources"]["limits"] == {"cpu": "1250m", "memory": "2048Mi"}
    assert grow_pod_level({"containers": []}, added) == []


def test_a_policy_cpu_limit_below_the_default_request_brings_the_request_down() -> None:
    p = policy(sidecar={"resources": {"limits": {"cpu": "100m"}}})
    sidecar = inject_pod(vllm_pod(None), [p]).pod["spec"]["initContainers"][1]
    # the API server refuses a container whose request is above its limit: 250m comes down
    assert sidecar["resources"]["requests"]["cpu"] == "100m"
    assert sidecar["resources"]["limits"]["cpu"] == "100m"


@pytest.mark.parametrize(
    ("resources", "words"),
    [
        (
            {"requests": {"cpu": "2"}, "limits": {"cpu": "1"}},
            "requests.cpu 2 is above limits.cpu 1",
        ),
        ({"requests": {"memory": "lots"}}, "spec.sidecar.resources.requests.memory"),
        ({"limit": {"cpu": "1"}}, "unknown field(s) 'limit'"),
    ],
)
def test_sidecar_resources_a_pod_could_not_be_created_with_are_refused(
    resources: dict[str, Any], words: str
) -> None:
    with pytest.raises(PolicyError, match=re.escape(words)):
        policy(sidecar={"resources": resources})
