"""The status of a ``placement: node`` policy: no sidecar is asked for Stats (the pods have
none), the ``NodePlacement`` condition says so and names the node pool's tenant, and nothing
the scheduler cannot place is blamed on kvoffload (nothing injected requests the pool)."""

from __future__ import annotations

from typing import Any

import kopf
import pytest
from kvoffload_operator import annotations as ann
from kvoffload_operator.handlers import _refresh_status
from kvoffload_operator.inject import SIDECAR_NAME, inject_pod
from kvoffload_operator.settings import OperatorConfig
from kvoffload_operator.sidecar_stats import StatsAnswer
from kvoffload_operator.status import build_status

from tests.operator.test_node_placement import policy, vllm_pod


def injected(name: str, p: Any, **status: Any) -> dict[str, Any]:
    pod = inject_pod(vllm_pod(), [p]).pod
    pod["metadata"] |= {"name": name, "namespace": "ns", "uid": f"uid-{name}"}
    pod["status"] = {"phase": "Running", "podIP": "10.0.0.9", **status}
    return pod


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_the_status_of_a_node_policy_names_its_pool_and_asks_no_sidecar() -> None:
    p = policy()
    unschedulable = {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/3 nodes are available: 3 Insufficient memory.",
            }
        ],
    }
    pods = [injected("a", p), injected("b", p, **unschedulable)]
    status = build_status(p, pods, [p], namespace_enabled=True, now="t")
    cond = conditions(status)
    node = cond["NodePlacement"]
    assert (node["status"], node["reason"]) == ("True", "SidecarStatsNotAsked")
    assert "'team-a'" in node["message"] and "KVOffloadNodePool 'gpu-nodes'" in node["message"]
    assert cond["Ready"]["message"] == (
        "2 pods matched, 2 injected, using tenant 'team-a' of node pool 'gpu-nodes'"
    )
    # nothing injected requests the pool: the scheduler's shortage is not kvoffload's doing
    assert cond["Degraded"]["status"] == "False" and status["degradedPods"] == 0
    assert (status["injectedPods"], status["readySidecars"], status["unreachableSidecars"]) == (
        2,
        0,
        0,
    )
    assert (status["poolCapacityBytes"], status["poolUsed"]) == (0, "0")
    # a pod-placement policy has no such condition, and the shortage is named there
    q = policy({"size": "8Gi"})
    pod_status = build_status(q, [injected("b", q, **unschedulable)], [q], namespace_enabled=True,
                              now="t")  # fmt: skip
    assert "NodePlacement" not in conditions(pod_status)
    assert conditions(pod_status)["Degraded"]["reason"] == "Unschedulable"
    # a policy moved from node to pod placement drops the condition
    moved = build_status(q, [], [q], namespace_enabled=True, now="t", previous=status)
    assert "NodePlacement" not in conditions(moved)


class _Api:
    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.pods = pods
        self.events: list[tuple[Any, ...]] = []

    def namespace_labels(self, namespace: str) -> dict[str, str]:
        return {ann.NAMESPACE_INJECTION: "enabled"}

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return self.pods

    def post_pod_event(self, *args: Any) -> None:
        self.events.append(args)


class _Source:
    def __init__(self) -> None:
        self.asked: list[str] = []

    def stats(self, target: str, timeout: float) -> StatsAnswer:
        self.asked.append(target)
        return StatsAnswer("no pool", "[]", 1 << 30, 0)


@pytest.mark.parametrize("placement", ["node", "pod"])
def test_the_status_refresh_asks_sidecars_only_with_pod_placement(placement: str) -> None:
    """The operator's timer path with a recording Stats source: a node policy's running pods
    are never dialed; a pod policy's started sidecar is (the control)."""
    p = policy() if placement == "node" else policy({"size": "8Gi"})
    sidecar = {"name": SIDECAR_NAME, "started": True, "ready": True}
    pod = injected("a", p, initContainerStatuses=[sidecar])  # a sidecar status, even for node
    memo = kopf.Memo()
    memo.api, memo.config = _Api([pod]), OperatorConfig()
    memo["stats_source"] = source = _Source()
    patch = kopf.Patch()
    _refresh_status(p, memo, {"ns": [p]}, {}, patch)
    status = patch["status"]
    if placement == "node":
        assert source.asked == [] and memo.api.events == []
        assert "NodePlacement" in conditions(status)
        assert conditions(status)["Degraded"]["status"] == "False"
    else:
        assert source.asked == ["10.0.0.9:9400"]
        assert conditions(status)["Degraded"]["reason"] == "PoolUnavailable"
        assert len(memo.api.events) == 1
