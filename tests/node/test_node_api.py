"""The agent against the API (kmock): it follows its KVOffloadNodePool, refuses grants past its
pool, writes only its own node's status entry, and grants no tenant unless the CSIDriver passes
pod info; a pod it cannot grant is published all the same, its sockets saying why. A real agent
process; the kubelet stand-in runs in threads so kmock keeps serving."""

from __future__ import annotations

import asyncio
import copy
import shutil
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any
from unittest.mock import ANY

import grpc
import pytest
from kvoffload_connector.common.node_memory import NodeMemoryError, open_tenant_memory
from kvoffload_sidecar.node.kube import ApiConfig, KubeClient
from nodeharness import POD_A, POD_B, Agent, Kubelet, MiB, make_root, pool_call

from tests.operator.harness import eventually

pytestmark = pytest.mark.process

POOLS = "kvoffload.io/v1alpha1/kvoffloadnodepools"
DRIVERS = "storage.k8s.io/v1/csidrivers"
PATH = "/apis/kvoffload.io/v1alpha1/kvoffloadnodepools/node-pool"
ALPHA = {"name": "alpha", "share": "4Mi", "namespaces": ["team-a"]}
BETA = {"name": "beta", "share": "2Mi", "namespaces": ["team-b"], "serviceAccounts": ["vllm"]}
DRIVER_SPEC = {
    "attachRequired": False,
    "podInfoOnMount": True,
    "volumeLifecycleModes": ["Ephemeral"],
}
POOL_BYTES = 8 * MiB  # a later --pool-bytes in a test wins
OTHER_NODE = {"publishedPods": 3, "conditions": [{"type": "Ready", "status": "True"}]}


def pool(*tenants: dict[str, Any], generation: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "kvoffload.io/v1alpha1",
        "kind": "KVOffloadNodePool",
        "metadata": {"name": "node-pool", "generation": generation, "resourceVersion": "1"},
        "spec": {"tenants": list(tenants)},
        "status": {"nodes": {"node-b": OTHER_NODE}},
    }


def declare(kmock: Any, obj: dict[str, Any] | None, driver: dict[str, Any] | None) -> None:
    for key, kind in ((POOLS, "KVOffloadNodePool"), (DRIVERS, "CSIDriver")):
        kmock.resources[key].kind = kind
        kmock.resources[key].namespaced = False
        kmock.resources[key].verbs = {"get", "list", "watch", "patch"}
    kmock.resources[POOLS].subresources = {"status"}
    if obj is not None:
        kmock.objects[POOLS, None, "node-pool"] = copy.deepcopy(obj)
    if driver is not None:
        kmock.objects[DRIVERS, None, "node.kvoffload.io"] = {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "CSIDriver",
            "metadata": {"name": "node.kvoffload.io"},
            "spec": driver,
        }


async def start_agent(kmock: Any, *extra: str) -> tuple[Agent, Kubelet]:
    root = make_root()
    agent = Agent(root, "--resync-seconds", "5", "--pool-bytes", str(POOL_BYTES), *extra)
    agent.pool_args = ["--node-pool-name", "node-pool", "--api-server", str(kmock.url)]
    await asyncio.to_thread(agent.start)
    return agent, Kubelet(root, agent.csi_socket)


@pytest.fixture
async def running(kmock: Any) -> AsyncIterator[Any]:
    started: list[tuple[Agent, Kubelet]] = []

    async def go(
        obj: dict[str, Any] | None, driver: dict[str, Any] | None = DRIVER_SPEC, *extra: str
    ):
        declare(kmock, obj, driver)
        started.append(await start_agent(kmock, *extra))
        return started[-1]

    yield go
    for agent, kubelet in started:
        kubelet.channel.close()
        await asyncio.to_thread(agent.stop)
        print(agent.log.read_text())  # shown when the test fails
        shutil.rmtree(agent.root, ignore_errors=True)


def node_entry(kmock: Any, node: str = "node-a") -> dict[str, Any]:
    return (
        (kmock.objects[POOLS, None, "node-pool"].raw.get("status") or {}).get("nodes") or {}
    ).get(node) or {}


def condition(entry: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in entry.get("conditions") or [] if c["type"] == type_), {})


async def patch_spec(kmock: Any, generation: int, *tenants: dict[str, Any]) -> None:
    """What `kubectl edit` does (the API server bumps the generation; kmock is told to)."""
    client = KubeClient(ApiConfig(str(kmock.url)))
    body = {"metadata": {"generation": generation}, "spec": {"tenants": list(tenants)}}
    await asyncio.to_thread(client.merge_patch, PATH, body)


async def publish_code(kubelet: Kubelet, pod) -> grpc.StatusCode:
    try:
        await asyncio.to_thread(kubelet.publish, pod)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def eventually_code(kubelet: Kubelet, pod, code: grpc.StatusCode) -> None:
    async def check() -> bool:
        return await publish_code(kubelet, pod) == code

    await eventually(check, timeout=10)


def _sockets(kubelet: Kubelet, pod) -> tuple[str, str, str]:
    """What the pod's sockets answer now: memory.sock's code, pool.sock's Stats code, and the
    refusal message (empty when both serve)."""
    try:
        open_tenant_memory(str(kubelet.target(pod) / "memory.sock"), pod.tenant).close()
        memory, message = "OK", ""
    except NodeMemoryError as e:
        memory, message = e.code, e.message
    code, details = pool_call(kubelet.short(pod), "Stats")
    return memory, code.name, message or details


async def sockets(kubelet: Kubelet, pod) -> tuple[str, str, str]:
    return await asyncio.to_thread(_sockets, kubelet, pod)


async def eventually_served(kubelet: Kubelet, pod, code: str, timeout: float = 10) -> str:
    """Until both of the pod's sockets answer `code` (OK: its tenant's memfd and Pool); the
    refusal message."""

    async def check() -> str | bool:
        memory, pool_code, message = await sockets(kubelet, pod)
        return (memory, pool_code) == (code, code) and (message or "served")

    return await eventually(check, timeout=timeout)


def fresh(pod, **kw: str):
    return replace(pod, uid=str(uuid.uuid4()), name=f"{pod.name}-{uuid.uuid4().hex[:6]}", **kw)


async def test_a_changed_grant_serves_new_publishes_and_published_pods_keep_theirs(
    kmock: Any, running: Any
) -> None:
    ok, denied = grpc.StatusCode.OK, "PERMISSION_DENIED"
    agent, kubelet = await running(pool(ALPHA))
    assert await publish_code(kubelet, POD_A) == ok
    await eventually_served(kubelet, POD_A, "OK")
    # beta not granted: the pod is published all the same, its sockets refuse with the reason
    assert await publish_code(kubelet, POD_B) == ok
    why = await eventually_served(kubelet, POD_B, denied)
    assert "'beta' is not granted to namespace team-b service account vllm" in why
    assert not (kubelet.target(POD_B) / "session.sock").exists()
    await eventually(lambda: node_entry(kmock).get("ungrantedPods") == 1)

    # a tenant added: the published pod gets it without a restart or a new publish, and keeps
    # it from then on, as a pod granted at publish (its record says so)
    await patch_spec(kmock, 2, ALPHA, BETA)
    await eventually_served(kubelet, POD_B, "OK")
    assert (kubelet.target(POD_B) / "session.sock").exists()  # its real servers now
    assert "tenant beta granted" in agent.log.read_text()
    await eventually(lambda: node_entry(kmock).get("ungrantedPods") == 0)

    # a service account list changed: only the named one gets alpha from then on
    await patch_spec(kmock, 3, {**ALPHA, "serviceAccounts": ["other"]}, BETA)
    refused_sa = fresh(POD_A)

    async def refused_after_gen_3() -> bool:
        if node_entry(kmock).get("observedGeneration") != 3:
            return False
        return await publish_code(kubelet, refused_sa) == ok

    await eventually(refused_after_gen_3)
    await eventually_served(kubelet, refused_sa, denied)
    named_sa = fresh(POD_A, service_account="other")
    assert await publish_code(kubelet, named_sa) == ok
    await eventually_served(kubelet, named_sa, "OK")

    # alpha removed: new pods do not get it, the published ones keep their memory until they go
    await patch_spec(kmock, 4, BETA)
    entry = await eventually(
        lambda: node_entry(kmock).get("observedGeneration") == 4 and node_entry(kmock)
    )
    late = fresh(POD_A, service_account="other")
    assert await publish_code(kubelet, late) == ok
    assert "is not granted" in await eventually_served(kubelet, late, denied)
    mapping = await asyncio.to_thread(
        open_tenant_memory, str(kubelet.target(POD_A) / "memory.sock"), "alpha"
    )
    try:
        assert mapping.size == 4 * MiB
    finally:
        mapping.close()
    assert (await sockets(kubelet, named_sa))[:2] == ("OK", "OK")
    entry = await eventually(
        lambda: node_entry(kmock).get("ungrantedPods") == 2 and node_entry(kmock)
    )
    alpha = next(t for t in entry["tenants"] if t["name"] == "alpha")
    # POD_A and named_sa hold alpha; refused_sa and late were published without it
    assert alpha["granted"] is False and alpha["publishedPods"] == 2 and alpha["bytes"] == 4 * MiB
    assert entry["publishedPods"] == 5
    await asyncio.to_thread(kubelet.unpublish, POD_A)
    assert await publish_code(kubelet, POD_A) == ok
    await eventually_served(kubelet, POD_A, denied)  # published again: a new pod, no grant
    assert agent.proc is not None and agent.proc.poll() is None


async def test_grants_past_the_pool_are_refused_and_the_last_good_ones_kept(
    kmock: Any, running: Any
) -> None:
    agent, kubelet = await running(pool(ALPHA), DRIVER_SPEC, "--pool-bytes", str(6 * MiB))
    await eventually_code(kubelet, POD_A, grpc.StatusCode.OK)
    await eventually_served(kubelet, POD_A, "OK")
    # 4 + 4 MiB > 6 MiB: refused whole, beta's pods not granted, alpha's still are
    await patch_spec(kmock, 2, ALPHA, {**BETA, "share": "4Mi"})
    entry = await eventually(
        lambda: (
            condition(node_entry(kmock), "GrantsRejected").get("status") == "True"
            and node_entry(kmock)
        )
    )
    rejected = condition(entry, "GrantsRejected")
    assert rejected["reason"] == "PoolExceeded"
    assert "6291456" in rejected["message"] and "generation 1 kept" in rejected["message"]
    assert entry["observedGeneration"] == 1
    assert condition(entry, "Ready")["status"] == "True"  # serving the last good grants
    assert await publish_code(kubelet, POD_B) == grpc.StatusCode.OK
    await eventually_served(kubelet, POD_B, "PERMISSION_DENIED")
    another = fresh(POD_A)
    assert await publish_code(kubelet, another) == grpc.StatusCode.OK
    await eventually_served(kubelet, another, "OK")
    # a grant that fits is taken again: the published pod of beta gets it
    await patch_spec(kmock, 3, ALPHA, BETA)
    await eventually_served(kubelet, POD_B, "OK")
    entry = await eventually(
        lambda: node_entry(kmock).get("observedGeneration") == 3 and node_entry(kmock)
    )
    assert condition(entry, "GrantsRejected")["status"] == "False"


async def test_a_pod_published_before_the_grants_are_read_gets_its_tenant_once_they_are(
    kmock: Any, running: Any
) -> None:
    """No pool object yet (the admin creates it after the agent started): the pod is published,
    its sockets answer UNAVAILABLE naming what the agent waits for, and it gets its tenant once
    the object exists, without a new publish."""
    agent, kubelet = await running(None)
    assert await publish_code(kubelet, POD_A) == grpc.StatusCode.OK
    why = await eventually_served(kubelet, POD_A, "UNAVAILABLE")
    assert "has not been read yet" in why
    kmock.objects[POOLS, None, "node-pool"] = copy.deepcopy(pool(ALPHA))
    await eventually_served(kubelet, POD_A, "OK", timeout=30)


async def test_the_status_entry_is_this_nodes_own_and_follows_its_pods(
    kmock: Any, running: Any
) -> None:
    agent, kubelet = await running(pool(ALPHA, BETA))
    await eventually_code(kubelet, POD_A, grpc.StatusCode.OK)
    await asyncio.to_thread(kubelet.publish, POD_B)
    entry = await eventually(
        lambda: node_entry(kmock).get("publishedPods") == 2 and node_entry(kmock)
    )
    assert entry["observedGeneration"] == 1
    assert (entry["poolBytes"], entry["usedBytes"], entry["freeBytes"]) == (
        8 * MiB,
        6 * MiB,
        2 * MiB,
    )
    assert [
        (t["name"], t["shareBytes"], t["bytes"], t["publishedPods"]) for t in entry["tenants"]
    ] == [
        ("alpha", 4 * MiB, 4 * MiB, 1),
        ("beta", 2 * MiB, 2 * MiB, 1),
    ]
    ready = condition(entry, "Ready")
    assert (ready["status"], ready["reason"], ready["observedGeneration"]) == ("True", "Serving", 1)
    assert ready["lastTransitionTime"].endswith("Z")
    assert node_entry(kmock, "node-b") == OTHER_NODE  # another node's entry is not touched
    # every write is a merge patch of the status subresource naming this node only
    writes = [r for r in kmock if r.method.value == "PATCH"]
    assert writes and all(r.url.path == f"{PATH}/status" for r in writes)
    assert all(r.headers["Content-Type"] == "application/merge-patch+json" for r in writes)
    assert all(r.data == {"status": {"nodes": {"node-a": ANY}}} for r in writes)
    await asyncio.sleep(1.1)  # past the timestamps' one-second resolution
    await asyncio.to_thread(kubelet.unpublish, POD_B)
    await eventually(lambda: node_entry(kmock).get("publishedPods") == 1)
    # a new generation that leaves a condition's status as it was keeps its transition time
    await asyncio.sleep(1.1)  # past the timestamps' one-second resolution
    await patch_spec(kmock, 2, ALPHA, BETA)
    entry = await eventually(
        lambda: node_entry(kmock).get("observedGeneration") == 2 and node_entry(kmock)
    )
    assert condition(entry, "Ready")["lastTransitionTime"] == ready["lastTransitionTime"]
    assert condition(entry, "Ready")["observedGeneration"] == 2


@pytest.mark.parametrize(
    ("driver", "why"),
    [
        ({**DRIVER_SPEC, "podInfoOnMount": False}, "lacks podInfoOnMount: true"),
        ({k: v for k, v in DRIVER_SPEC.items() if k != "podInfoOnMount"}, "lacks podInfoOnMount"),
        ({**DRIVER_SPEC, "volumeLifecycleModes": ["Persistent", "Ephemeral"]}, "[Ephemeral]"),
        (None, "does not exist"),
    ],
    ids=["pod-info-false", "pod-info-unset", "persistent-too", "no-driver"],
)
async def test_no_tenant_is_granted_unless_the_csidriver_passes_pod_info(
    kmock: Any, running: Any, driver: dict[str, Any] | None, why: str
) -> None:
    agent, kubelet = await running(pool(ALPHA), driver)
    entry = await eventually(
        lambda: (
            condition(node_entry(kmock), "Ready").get("reason") == "CSIDriverUntrusted"
            and node_entry(kmock)
        )
    )
    assert condition(entry, "Ready")["status"] == "False"
    assert why in condition(entry, "Ready")["message"]
    # the mount succeeds (the pod starts), its sockets give it nothing and say why
    assert await publish_code(kubelet, POD_A) == grpc.StatusCode.OK
    message = await eventually_served(kubelet, POD_A, "UNAVAILABLE")
    assert why in message and "grants no tenant yet" in message
    # the CSIDriver fixed: the published pod gets its tenant (the agent reads the driver again
    # while it does not pass, every --resync-seconds up to 30 s)
    declare(kmock, None, DRIVER_SPEC)
    await eventually_served(kubelet, POD_A, "OK", timeout=20)
    ready = await eventually(
        lambda: (
            condition(node_entry(kmock), "Ready").get("status") == "True"
            and condition(node_entry(kmock), "Ready")
        )
    )
    assert ready["reason"] == "Serving"


def test_a_new_tenant_whose_memfd_cannot_be_made_is_refused_and_the_last_good_kept() -> None:
    from kvoffload_sidecar.node.follow import PoolFollower
    from kvoffload_sidecar.node.grants import NodePoolSpec
    from kvoffload_sidecar.node.holder import HolderError
    from kvoffload_sidecar.node.tenant_memory import TenantMemory, create_memfd

    def source(name: str, size: int) -> int:
        if name == "beta":
            raise HolderError("UNAVAILABLE", "the holder is gone")
        return create_memfd(name, size)

    memory = TenantMemory(NodePoolSpec("node-pool", ()), source=source)
    try:
        follower = PoolFollower(
            name="node-pool", node_id="node-a", pool_bytes=POOL_BYTES, memory=memory,
            bindings=list, client=None,  # type: ignore[arg-type]  # no API call here
        )  # fmt: skip
        assert follower.apply(pool(ALPHA))
        assert not follower.apply(pool(ALPHA, BETA, generation=2))
        assert [t.name for t in follower.spec().tenants] == ["alpha"]
        entry = follower.status_entry()
    finally:
        memory.close()
    rejected = condition(entry, "GrantsRejected")
    assert (rejected["status"], rejected["reason"]) == ("True", "MemoryUnavailable")
    assert "the holder is gone" in rejected["message"] and entry["observedGeneration"] == 1


def test_following_the_api_needs_the_nodes_pool_size() -> None:
    from kvoffload_sidecar.node.agent import main

    with pytest.raises(SystemExit) as refused:
        main(["--node-id", "node-a", "--node-pool-name", "node-pool", "--api-server", "http://x"])
    assert refused.value.code == 2
