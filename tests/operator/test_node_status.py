"""The status of a ``placement: node`` policy: no sidecar is asked for Stats (the pods have
none), the ``NodePlacement`` condition says so and names the node pool's tenant, and nothing
the scheduler cannot place is blamed on kvoffload (nothing injected requests the pool)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kopf
import pytest
from kvoffload_operator import annotations as ann
from kvoffload_operator.handlers import _refresh_status
from kvoffload_operator.inject import SIDECAR_NAME, inject_pod
from kvoffload_operator.k8s import ApiError
from kvoffload_operator.settings import OperatorConfig
from kvoffload_operator.sidecar_stats import StatsAnswer
from kvoffload_operator.status import NODE_DRIVER, NODE_VOLUME, build_status

from tests.operator.harness import NODE_POOLS, POLICIES, eventually, put, running_operator
from tests.operator.test_node_placement import NODE_POOL, policy, vllm_pod


def granting_pool() -> dict[str, Any]:
    """The KVOffloadNodePool the node policy names, granting its tenant to its namespace."""
    return {
        "apiVersion": "kvoffload.io/v1alpha1",
        "kind": "KVOffloadNodePool",
        "metadata": {"name": "gpu-nodes"},
        "spec": {"tenants": [{"name": "team-a", "share": "64Gi", "namespaces": ["ns"]}]},
    }


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

    def get_node_pool(self, name: str) -> dict[str, Any]:
        return granting_pool()

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


# -- pods no node agent lets start ---------------------------------------------------------------
# The kubelet's FailedMount messages (csi_mounter.go, csi_client.go, the volume manager).
NO_DRIVER = (
    'MountVolume.SetUp failed for volume "kvoffload-node" : kubernetes.io/csi: mounter.SetUpAt '
    "failed to get CSI client: driver name node.kvoffload.io not found in the list of "
    "registered CSI drivers"
)
AGENT_DOWN = (
    'MountVolume.SetUp failed for volume "kvoffload-node" : rpc error: code = Unavailable desc = '
    'connection error: desc = "transport: Error while dialing: dial unix '
    '/var/lib/kubelet/plugins/node.kvoffload.io/csi.sock: connect: connection refused"'
)
TIMED_OUT = (
    "Unable to attach or mount volumes: unmounted volumes=[kvoffload-node], unattached "
    "volumes=[kvoffload-node kube-api-access-7x2kq]: timed out waiting for the condition"
)
REFUSED = (
    'MountVolume.SetUp failed for volume "kvoffload-node" : rpc error: code = InvalidArgument '
    "desc = unknown volumeAttributes ['poolSize']: only 'tenant' is read"
)
OTHER_VOLUME = 'MountVolume.SetUp failed for volume "config" : configmap "llama-config" not found'
WAITING = {"state": {"waiting": {"reason": "ContainerCreating"}}}


def waiting(name: str, p: Any, node: str) -> dict[str, Any]:
    """An injected pod the kubelet has not started: Pending on its node, containers creating."""
    pod = injected(name, p, phase="Pending", containerStatuses=[{"name": "vllm", **WAITING}])
    pod["spec"]["nodeName"] = node
    return pod


def failed_mount(pod: dict[str, Any], message: str, at: str = "2026-01-01T00:00:00Z") -> dict:
    meta = pod["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{abs(hash(message)) % 10**8}", "namespace": "ns"},
        "involvedObject": {
            "kind": "Pod",
            "namespace": "ns",
            "name": meta["name"],
            "uid": meta["uid"],
        },
        "reason": "FailedMount",
        "type": "Warning",
        "message": message,
        "source": {"component": "kubelet", "host": pod["spec"].get("nodeName", "")},
        "lastTimestamp": at,
        "count": 3,
    }


def test_pods_no_node_agent_lets_start_degrade_a_node_policy_naming_their_nodes() -> None:
    p = policy()
    a, b, c = waiting("a", p, "node-1"), waiting("b", p, "node-2"), waiting("c", p, "node-2")
    # the volume the status looks for is the one the webhook injects
    (volume,) = [v for v in a["spec"]["volumes"] if "csi" in v]
    assert (volume["name"], volume["csi"]["driver"]) == (NODE_VOLUME, NODE_DRIVER)
    started = injected("d", p)  # mounted since: its old FailedMount is history
    started["spec"]["nodeName"] = "node-1"
    other = waiting("e", p, "node-1")  # waits for another volume: not kvoffload's
    events = [
        failed_mount(a, NO_DRIVER),
        failed_mount(b, REFUSED, "2026-01-01T00:00:00Z"),
        failed_mount(b, AGENT_DOWN, "2026-01-01T00:01:00Z"),  # the latest cause decides
        failed_mount(c, TIMED_OUT),
        failed_mount(started, NO_DRIVER),
        failed_mount(other, OTHER_VOLUME),
    ]
    pods = [a, b, c, started, other]
    status = build_status(p, pods, [p], namespace_enabled=True, now="t", events=events)
    degraded = conditions(status)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "NodeAgentUnavailable")
    assert degraded["message"].startswith(
        "3 injected pod(s) wait in ContainerCreating: no kvoffload node agent (CSI driver "
        "node.kvoffload.io) serves their volume on node(s) node-1, node-2: "
    )
    assert "a (node node-1: kubernetes.io/csi: mounter.SetUpAt failed" in degraded["message"]
    assert "b (node node-2: rpc error: code = Unavailable" in degraded["message"]
    for name in ("d (", "e ("):
        assert name not in degraded["message"]
    assert status["degradedPods"] == 3
    assert status["degradedReasons"] == {"NodeAgentUnavailable": 3}
    # the same events under a pod-placement policy: nothing of it is read there
    q = policy({"size": "8Gi"})
    pod_status = build_status(q, [waiting("a", q, "node-1")], [q], namespace_enabled=True,
                              now="t", events=[failed_mount(a, NO_DRIVER)])  # fmt: skip
    assert conditions(pod_status)["Degraded"]["status"] == "False"
    # the agent serves again: the pods start and the condition clears
    running = [injected(n, p) for n in ("a", "b", "c")]
    cleared = build_status(p, running, [p], namespace_enabled=True, now="t2", events=events,
                           previous=status)  # fmt: skip
    assert conditions(cleared)["Degraded"]["status"] == "False"
    assert cleared["degradedPods"] == 0


def test_a_refused_node_volume_is_named_apart_from_a_missing_agent() -> None:
    p = policy()
    f = waiting("f", p, "node-3")
    status = build_status(p, [f], [p], namespace_enabled=True, now="t",
                          events=[failed_mount(f, REFUSED)])  # fmt: skip
    degraded = conditions(status)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "NodeMountRefused")
    assert "refuses their volume on node(s) node-3" in degraded["message"]
    assert "code = InvalidArgument" in degraded["message"]
    # with a missing agent elsewhere, that is the reason (the first thing to fix); both named
    g = waiting("g", p, "node-4")
    both = build_status(p, [f, g], [p], namespace_enabled=True, now="t",
                        events=[failed_mount(f, REFUSED), failed_mount(g, NO_DRIVER)])  # fmt: skip
    degraded = conditions(both)["Degraded"]
    assert degraded["reason"] == "NodeAgentUnavailable"
    assert "on node(s) node-4:" in degraded["message"] and "f (node node-3:" in degraded["message"]
    assert both["degradedReasons"] == {"NodeAgentUnavailable": 1, "NodeMountRefused": 1}


class _EventsApi(_Api):
    def __init__(self, pods: list[dict[str, Any]], events: list[dict[str, Any]] | None) -> None:
        super().__init__(pods)
        self.failed_mounts = events
        self.asked_events = 0

    def list_failed_mounts(self, namespace: str) -> list[dict[str, Any]]:
        self.asked_events += 1
        if self.failed_mounts is None:
            raise ApiError(status=403, reason="Forbidden")
        return self.failed_mounts


def test_the_status_refresh_reads_failed_mounts_and_warns_each_waiting_pod_once() -> None:
    p = policy()
    a = waiting("a", p, "node-1")
    memo = kopf.Memo()
    memo.api, memo.config = _EventsApi([a], [failed_mount(a, NO_DRIVER)]), OperatorConfig()
    for _ in range(2):
        patch = kopf.Patch()
        _refresh_status(p, memo, {"ns": [p]}, {}, patch)
    assert conditions(patch["status"])["Degraded"]["reason"] == "NodeAgentUnavailable"
    (event,) = memo.api.events  # once per pod and reason
    namespace, pod, uid, field_path, reason, message, _ = event
    assert (namespace, pod, uid, field_path) == ("ns", "a", "uid-a", "")
    assert reason == "KVOffloadNodeAgentUnavailable"
    assert "on node node-1" in message and "nodeAgent.enabled" in message
    assert "nodeAgent.nodeSelector and nodeAgent.tolerations" in message
    # no pod waiting: the events are not even read
    memo.api = _EventsApi([injected("b", p)], [])
    _refresh_status(p, memo, {"ns": [p]}, {}, kopf.Patch())
    assert memo.api.asked_events == 0
    # a Role without list on events: no cause found, no failure
    memo.api = _EventsApi([a], None)
    patch = kopf.Patch()
    _refresh_status(p, memo, {"ns": [p]}, {}, patch)
    assert memo.api.asked_events == 1
    assert conditions(patch["status"])["Degraded"]["status"] == "False"


@pytest.mark.process
async def test_a_running_operator_names_the_pods_no_node_agent_lets_start(
    kmock: Any, tmp_path: Path
) -> None:
    """The operator loop against kmock: a node policy, one injected pod Pending on a node
    without the driver and the kubelet's FailedMount event: Degraded NodeAgentUnavailable
    naming the node, one Warning Event on the pod; the pod starts: the condition clears."""
    p = policy()
    put(kmock, POLICIES, {
        "apiVersion": "kvoffload.io/v1alpha1", "kind": "KVOffloadPolicy",
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {"selector": {}, "pool": NODE_POOL},
    })  # fmt: skip
    pod = waiting("a", p, "gpu-node-7")
    put(kmock, "v1/pods", pod)
    put(kmock, NODE_POOLS, granting_pool())
    # the kubelet's event, as the events list answers it (kmock's own store cannot hold it
    # beside the operator's generateName'd Warning: it matches a create to every object)
    listed = {"apiVersion": "v1", "kind": "EventList", "metadata": {},
              "items": [failed_mount(pod, NO_DRIVER)]}  # fmt: skip
    kmock["get /api/v1/namespaces/ns/events"] << listed
    async with running_operator(
        kmock, tmp_path, webhook_port=0, status_interval=0.3, injection_label=""
    ):

        def degraded(expected: str) -> Any:
            status = dict(kmock.objects[POLICIES, "ns", "p"].raw).get("status") or {}
            cond = conditions(status).get("Degraded", {}) if status.get("conditions") else {}
            return cond.get("status") == expected and status

        status = await eventually(lambda: degraded("True"))
        cond = conditions(status)["Degraded"]
        assert cond["reason"] == "NodeAgentUnavailable"
        assert "on node(s) gpu-node-7" in cond["message"]
        assert status["degradedReasons"] == {"NodeAgentUnavailable": 1}
        assert conditions(status)["NodePlacement"]["reason"] == "SidecarStatsNotAsked"

        def warnings() -> list[dict[str, Any]]:
            return [
                dict(o.raw)
                for key, o in kmock.objects.items()
                if key[0] == "v1/events" and o.raw.get("reason") == "KVOffloadNodeAgentUnavailable"
            ]

        (event,) = await eventually(warnings)
        asked = [r for r in kmock if r.method.value == "GET" and r.url.path.endswith("/events")]
        assert asked and all(
            r.url.query.get("fieldSelector") == "reason=FailedMount,involvedObject.kind=Pod"
            for r in asked
        )
        assert event["involvedObject"]["name"] == "a" and event["type"] == "Warning"
        assert "node gpu-node-7" in event["message"]
        # an agent serves there now: the kubelet mounts the volume and the pod starts
        put(kmock, "v1/pods", injected("a", p))
        await eventually(lambda: degraded("False"))
