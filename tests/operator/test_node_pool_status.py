"""A ``placement: node`` policy's status reads the KVOffloadNodePool it names: the pool missing
or not granting the tenant (to the policy's namespace, or to a pod's service account) degrades
the policy with the reason, before any pod exists too; a granting pool's capacity for the
tenant, summed over the nodes whose agent reports it, is the policy's SHARED capacity
(``status.nodePool``), never counted per replica."""

from __future__ import annotations

import copy
import datetime
from pathlib import Path
from typing import Any

import kopf
import pytest
from kvoffload_operator.handlers import _refresh_status, status_patch
from kvoffload_operator.k8s import ApiError
from kvoffload_operator.node_pool import NodePoolRead, stale_nodes
from kvoffload_operator.settings import OperatorConfig
from kvoffload_operator.status import build_status, degraded_problems, event_for

from tests.operator.harness import NODE_POOLS, POLICIES, eventually, put, running_operator
from tests.operator.test_node_placement import NODE_POOL, policy
from tests.operator.test_node_status import _Api, conditions, failed_mount, injected, waiting

GiB = 1 << 30


def node_entry(*tenants: dict[str, Any]) -> dict[str, Any]:
    return {"observedGeneration": 1, "poolBytes": 256 * GiB, "tenants": list(tenants)}


def pool(
    namespaces: tuple[str, ...] = ("ns",), service_accounts: tuple[str, ...] = ()
) -> dict[str, Any]:
    """gpu-nodes: team-a (64Gi a node) for ``namespaces``, team-b for another; four agents
    report: node-1 and node-2 hold team-a, node-3 a removed team-a's memfd (granted false),
    node-4 only team-b."""
    team_a: dict[str, Any] = {"name": "team-a", "share": "64Gi", "namespaces": list(namespaces)}
    if service_accounts:
        team_a["serviceAccounts"] = list(service_accounts)
    a = {"name": "team-a", "granted": True, "shareBytes": 64 * GiB, "bytes": 64 * GiB}
    b = {"name": "team-b", "granted": True, "shareBytes": 32 * GiB, "bytes": 32 * GiB,
         "publishedPods": 4}  # fmt: skip
    return {
        "apiVersion": "kvoffload.io/v1alpha1",
        "kind": "KVOffloadNodePool",
        "metadata": {"name": "gpu-nodes", "generation": 2},
        "spec": {"tenants": [team_a, {"name": "team-b", "share": "32Gi", "namespaces": ["b"]}]},
        "status": {
            "nodes": {
                "node-1": node_entry({**a, "publishedPods": 2}, b),
                "node-2": node_entry({**a, "publishedPods": 1}),
                "node-3": node_entry({**a, "granted": False, "shareBytes": 0, "bytes": 32 * GiB}),
                "node-4": node_entry(b),
            }
        },
    }


def read(obj: dict[str, Any] | None, **kw: Any) -> NodePoolRead:
    return NodePoolRead("gpu-nodes", "team-a", "ns", obj=obj, **kw)


def test_a_granting_pool_gives_the_tenants_shared_capacity_once_per_node() -> None:
    p = policy()
    pods = [injected("a", p), injected("b", p)]
    status = build_status(p, pods, [p], namespace_enabled=True, now="t", node_pool=read(pool()))
    assert conditions(status)["Degraded"]["status"] == "False"
    assert status["nodePool"] == {
        "name": "gpu-nodes",
        "tenant": "team-a",
        "found": True,
        "granted": True,
        "nodes": 2,  # node-3's memfd is a removed grant's, node-4 holds no team-a
        "publishedPods": 3,
        "sharedCapacityBytes": 128 * GiB,
        "sharedCapacity": "128Gi",
    }
    # the per-replica sums stay a sidecar's: two replicas do not make it 256Gi
    assert (status["poolCapacityBytes"], status["poolCapacity"]) == (0, "0")
    assert "status.nodePool" in conditions(status)["NodePlacement"]["message"]


def test_a_missing_pool_degrades_the_policy_naming_it_before_any_pod_too() -> None:
    p = policy()
    alone = build_status(p, [], [p], namespace_enabled=True, now="t", node_pool=read(None))
    degraded = conditions(alone)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "NodePoolNotFound")
    assert degraded["message"].startswith("KVOffloadNodePool 'gpu-nodes' does not exist")
    assert degraded["message"].endswith("(no injected pod yet)")
    assert alone["degradedPods"] == 0
    assert alone["nodePool"] == {"name": "gpu-nodes", "tenant": "team-a", "found": False,
                                 "granted": False, "nodes": 0, "publishedPods": 0,
                                 "sharedCapacityBytes": 0, "sharedCapacity": "0"}  # fmt: skip
    pods = [injected("a", p), injected("b", p)]
    status = build_status(p, pods, [p], namespace_enabled=True, now="t2", node_pool=read(None),
                          previous=alone)  # fmt: skip
    degraded = conditions(status)["Degraded"]
    assert degraded["reason"] == "NodePoolNotFound"
    assert degraded["message"].startswith(
        "2 injected pod(s) serve without the kvoffload node pool: a (NodePoolNotFound: "
        "KVOffloadNodePool 'gpu-nodes' does not exist"
    )
    assert degraded["lastTransitionTime"] == "t"  # still True since the first refresh
    assert (status["degradedPods"], status["degradedReasons"]) == (2, {"NodePoolNotFound": 2})


@pytest.mark.parametrize(
    ("obj", "words"),
    [
        (pool(namespaces=("other",)), "tenant 'team-a' of KVOffloadNodePool 'gpu-nodes' is not "
                                      "granted to namespace 'ns'"),
        ({**pool(), "spec": {"tenants": [{"name": "b", "share": "1Gi", "namespaces": ["ns"]}]}},
         "KVOffloadNodePool 'gpu-nodes' has no tenant 'team-a'"),
    ],
    ids=["other-namespace", "no-such-tenant"],
)  # fmt: skip
def test_a_pool_not_granting_the_tenant_to_the_namespace_degrades_it(obj, words) -> None:
    p = policy()
    status = build_status(p, [injected("a", p)], [p], namespace_enabled=True, now="t",
                          node_pool=read(obj))  # fmt: skip
    degraded = conditions(status)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "TenantNotGranted")
    assert words in degraded["message"], degraded["message"]
    # its nodes report team-a's memory, but none of it is this policy's: no capacity
    assert status["nodePool"]["granted"] is False
    assert status["nodePool"]["sharedCapacityBytes"] == 0


def test_a_grant_for_other_service_accounts_refuses_only_the_pods_running_as_others() -> None:
    p = policy()
    mine = injected("a", p)
    mine["spec"]["serviceAccountName"] = "vllm"
    other = injected("b", p)
    other["spec"].pop("serviceAccountName", None)  # the namespace's default account
    obj = pool(service_accounts=("vllm",))
    status = build_status(p, [mine, other], [p], namespace_enabled=True, now="t",
                          node_pool=read(obj))  # fmt: skip
    degraded = conditions(status)["Degraded"]
    assert (degraded["reason"], status["degradedPods"]) == ("TenantNotGranted", 1)
    assert "b (TenantNotGranted: tenant 'team-a'" in degraded["message"]
    assert "service accounts vllm, not to 'default'" in degraded["message"]
    assert "a (" not in degraded["message"]
    assert status["nodePool"]["granted"] is True  # the namespace is
    assert status["nodePool"]["sharedCapacityBytes"] == 128 * GiB
    (problem,) = degraded_problems([mine, other], node=True, node_pool=read(obj))
    reason, message = event_for(problem)
    assert reason == "KVOffloadTenantNotGranted"
    assert "serves without the node pool" in message and "tokens unchanged" in message


def test_a_pod_no_agent_lets_start_is_named_for_that_and_the_pool_for_the_others() -> None:
    p = policy()
    stuck, running = waiting("a", p, "node-9"), injected("b", p)
    status = build_status(p, [stuck, running], [p], namespace_enabled=True, now="t",
                          events=[failed_mount(stuck, "MountVolume.SetUp failed for volume "
                                  '"kvoffload-node" : driver name node.kvoffload.io not found '
                                  "in the list of registered CSI drivers")],
                          node_pool=read(None))  # fmt: skip
    degraded = conditions(status)["Degraded"]
    assert degraded["reason"] == "NodeAgentUnavailable"  # a pod that cannot start comes first
    assert status["degradedReasons"] == {"NodeAgentUnavailable": 1, "NodePoolNotFound": 1}


def test_an_unreadable_pool_degrades_nothing_and_the_condition_says_why() -> None:
    p = policy()
    unread = read(None, readable=False, error="403 Forbidden")
    status = build_status(p, [injected("a", p)], [p], namespace_enabled=True, now="t",
                          node_pool=unread)  # fmt: skip
    assert conditions(status)["Degraded"]["status"] == "False"
    assert status["nodePool"] == {"name": "gpu-nodes", "tenant": "team-a"}
    assert (
        "could not read that pool: 403 Forbidden" in conditions(status)["NodePlacement"]["message"]
    )


def test_a_policy_moved_to_pod_placement_drops_its_node_pool_status() -> None:
    p = policy()
    before = build_status(p, [], [p], namespace_enabled=True, now="t", node_pool=read(pool()))
    q = policy({"size": "8Gi"})
    after = build_status(q, [], [q], namespace_enabled=True, now="t", previous=before)
    assert after["nodePool"] is None  # a merge patch's null: the API server drops it
    assert status_patch(before, after)["nodePool"] is None
    again = build_status(q, [], [q], namespace_enabled=True, now="t", previous=after)
    assert "nodePool" not in again


class _PoolApi(_Api):
    def __init__(self, pods: list[dict[str, Any]], answer: Any, nodes: Any = None) -> None:
        super().__init__(pods)
        self.answer = answer
        self.asked: list[str] = []
        self.nodes = {"node-1", "node-2", "node-3", "node-4"} if nodes is None else nodes
        self.looked_up: list[str] = []
        self.patches: list[tuple[str, dict[str, Any]]] = []

    def node_exists(self, name: str) -> bool:
        self.looked_up.append(name)
        if isinstance(self.nodes, ApiError):
            raise self.nodes
        return name in self.nodes

    def patch_node_pool_status(self, name: str, body: dict[str, Any]) -> None:
        self.patches.append((name, body))

    def get_node_pool(self, name: str) -> dict[str, Any] | None:
        self.asked.append(name)
        if isinstance(self.answer, ApiError):
            raise self.answer
        return copy.deepcopy(self.answer)


def test_the_status_refresh_reads_the_named_pool_and_warns_each_refused_pod_once() -> None:
    p = policy()
    memo = kopf.Memo()
    memo.api, memo.config = _PoolApi([injected("a", p)], None), OperatorConfig()
    for _ in range(2):
        patch = kopf.Patch()
        _refresh_status(p, memo, {"ns": [p]}, {}, patch)
    assert memo.api.asked == ["gpu-nodes", "gpu-nodes"]  # by name, at each refresh
    assert conditions(patch["status"])["Degraded"]["reason"] == "NodePoolNotFound"
    (event,) = memo.api.events
    assert event[:5] == ("ns", "a", "uid-a", "", "KVOffloadNodePoolNotFound")
    # no RBAC for pools: nothing blamed, said on NodePlacement
    memo.api = _PoolApi([injected("a", p)], ApiError(status=403, reason="Forbidden"))
    patch = kopf.Patch()
    _refresh_status(p, memo, {"ns": [p]}, {}, patch)
    status = patch["status"]
    assert conditions(status)["Degraded"]["status"] == "False"
    assert "lacks get on kvoffloadnodepools" in conditions(status)["NodePlacement"]["message"]
    # a pod-placement policy reads no pool
    memo.api = _PoolApi([], None)
    _refresh_status(policy({"size": "8Gi"}), memo, {"ns": []}, {}, kopf.Patch())
    assert memo.api.asked == []


@pytest.mark.process
async def test_a_running_operator_follows_the_node_pool_it_names(
    kmock: Any, tmp_path: Path
) -> None:
    """The operator loop against kmock: a node policy with a running injected pod and no pool
    object: Degraded NodePoolNotFound, a Warning Event on the pod; the admin creates the pool
    for another namespace: TenantNotGranted; then grants the policy's namespace, and the agents'
    entries report team-a on two nodes, one of them deleted: its entry is pruned, Degraded
    clears and status.nodePool carries the shared capacity of the node left. The operator
    GETs the pool and the nodes by name and patches only the pool's status."""
    p = policy()
    put(kmock, POLICIES, {
        "apiVersion": "kvoffload.io/v1alpha1", "kind": "KVOffloadPolicy",
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {"selector": {}, "pool": NODE_POOL},
    })  # fmt: skip
    put(kmock, "v1/pods", injected("a", p))
    for node in ("node-1", "node-3", "node-4"):  # node-2 was deleted: its entry is stale
        put(kmock, "v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
    async with running_operator(
        kmock, tmp_path, webhook_port=0, status_interval=0.3, injection_label=""
    ):

        def status_with(check: Any) -> Any:
            status = dict(kmock.objects[POLICIES, "ns", "p"].raw).get("status") or {}
            return status.get("conditions") and check(status) and status

        def degraded_by(reason: str) -> Any:
            return status_with(lambda s: conditions(s)["Degraded"].get("reason") == reason)

        status = await eventually(lambda: degraded_by("NodePoolNotFound"))
        assert status["degradedReasons"] == {"NodePoolNotFound": 1}
        assert status["nodePool"]["found"] is False

        def warnings() -> list[dict[str, Any]]:
            return [dict(o.raw) for key, o in kmock.objects.items()
                    if key[0] == "v1/events"
                    and o.raw.get("reason") == "KVOffloadNodePoolNotFound"]  # fmt: skip

        (event,) = await eventually(warnings)
        assert event["involvedObject"]["name"] == "a" and event["type"] == "Warning"
        # kmock keeps one generateName'd Event per namespace (it names none): make room for
        # the next reason's
        for key in [k for k in kmock.objects if k[0] == "v1/events"]:
            del kmock.objects[key]

        put(kmock, NODE_POOLS, pool(namespaces=("other",)))
        status = await eventually(lambda: degraded_by("TenantNotGranted"))
        assert "not granted to namespace 'ns'" in conditions(status)["Degraded"]["message"]

        put(kmock, NODE_POOLS, pool())
        status = await eventually(
            lambda: status_with(
                lambda s: (
                    conditions(s)["Degraded"]["status"] == "False"
                    and s.get("nodePool", {}).get("nodes") == 1
                )
            )
        )
        # node-2's entry pruned (its node is gone): node-1's 64Gi is the tenant's capacity
        assert status["nodePool"]["sharedCapacityBytes"] == 64 * GiB
        assert (status["nodePool"]["sharedCapacity"], status["nodePool"]["publishedPods"]) == (
            "64Gi", 2)  # fmt: skip
        assert status["degradedPods"] == 0 and "NodePoolNotFound" not in status["degradedReasons"]
        entries = dict(kmock.objects[NODE_POOLS, None, "gpu-nodes"].raw)["status"]["nodes"]
        assert entries.get("node-2") is None and entries["node-1"] and entries["node-4"]
        pools = [r for r in kmock if "kvoffloadnodepools" in r.url.path]
        path = "/apis/kvoffload.io/v1alpha1/kvoffloadnodepools/gpu-nodes"
        assert {(r.method.value, r.url.path) for r in pools} == {
            ("GET", path),
            ("PATCH", f"{path}/status"),
        }
        patches = [r.data for r in pools if r.method.value == "PATCH"]
        assert patches and all(
            body == {"metadata": {"resourceVersion": "1"}, "status": {"nodes": {"node-2": None}}}
            for body in patches
        ), patches
        # nodes are read by name, never listed; existing ones once (remembered)
        nodes = [
            (r.method.value, r.url.path) for r in kmock if r.url.path.startswith("/api/v1/nodes")
        ]
        assert ("GET", "/api/v1/nodes/node-2") in nodes and ("GET", "/api/v1/nodes") not in nodes
        assert nodes.count(("GET", "/api/v1/nodes/node-1")) == 1


def test_entries_of_gone_nodes_are_pruned_once_looked_up_and_fresh_ones_are_not() -> None:
    """Only entries no agent rewrote for 15 minutes are looked up; of those, a node that does
    not exist loses its entry (a merge patch conditioned on the resourceVersion read), one that
    exists is not asked again within that time; a failure leaves every entry."""
    p = policy()
    now = datetime.datetime.now(datetime.timezone.utc)
    obj = pool()
    obj["metadata"]["resourceVersion"] = "7"
    fresh = (now - datetime.timedelta(minutes=4)).isoformat().replace("+00:00", "Z")
    old = (now - datetime.timedelta(minutes=16)).isoformat().replace("+00:00", "Z")
    nodes = obj["status"]["nodes"]
    nodes["node-1"]["lastUpdateTime"] = fresh
    nodes["node-2"]["lastUpdateTime"] = old
    nodes["node-3"]["lastUpdateTime"] = "not a time"
    assert stale_nodes(obj, now) == ["node-2", "node-3", "node-4"]  # node-4: no time at all
    memo = kopf.Memo()
    memo.api = _PoolApi([injected("a", p)], obj, nodes={"node-1", "node-3", "node-4"})
    memo.config = OperatorConfig()
    patch = kopf.Patch()
    _refresh_status(p, memo, {"ns": [p]}, {}, patch)
    assert memo.api.looked_up == ["node-2", "node-3", "node-4"]
    assert memo.api.patches == [
        ("gpu-nodes", {"metadata": {"resourceVersion": "7"}, "status": {"nodes": {"node-2": None}}})
    ]
    # this refresh's capacity already leaves node-2 out
    assert patch["status"]["nodePool"]["nodes"] == 1
    assert patch["status"]["nodePool"]["sharedCapacityBytes"] == 64 * GiB
    _refresh_status(p, memo, {"ns": [p]}, {}, kopf.Patch())
    assert memo.api.looked_up == ["node-2", "node-3", "node-4", "node-2"]  # known ones not again
    # no right to read nodes: nothing pruned, the status computed all the same
    memo = kopf.Memo()
    memo.api = _PoolApi([injected("a", p)], obj, nodes=ApiError(status=403, reason="Forbidden"))
    memo.config = OperatorConfig()
    patch = kopf.Patch()
    _refresh_status(p, memo, {"ns": [p]}, {}, patch)
    assert memo.api.patches == [] and patch["status"]["nodePool"]["nodes"] == 2
