"""The operator upgrading the node agent in place, against the kmock API emulator: two agent
pods patched one after the other (the test plays the kubelet, restarting the agent container
with its new image), only the agent container's image changed, the holder and the registrar
untouched, no pod deleted; a pod that does not come back in time stops the upgrade with a
Warning Event on the DaemonSet until it does."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

import pytest
from kvoffload_operator import agent_upgrade as au

from tests.operator.harness import eventually, put, running_operator

pytestmark = pytest.mark.process

NS = "kvoffload-system"
DAEMONSETS, PODS = "apps/v1/daemonsets", "v1/pods"
DS_NAME = "kv-kvoffload-node-agent"
OLD, NEW = "registry.example/kvoffload:0.1.0", "registry.example/kvoffload:0.2.0"
SELECTOR = {"app.kubernetes.io/component": "node-agent", "app.kubernetes.io/instance": "kv"}
ARGS = ["node-agent", "--csi-socket=/csi/csi.sock", "--holder-socket=/run/h/holder.sock"]


def containers(image: str) -> tuple[list[dict], list[dict]]:
    holder = [{"name": "holder", "image": image, "restartPolicy": "Always",
               "args": ["node-holder", "--prefault"]}]  # fmt: skip
    main = [
        {"name": "agent", "image": image, "args": ARGS},
        {"name": "node-driver-registrar", "image": "registrar:v2.13.0"},
    ]
    return holder, main


def daemonset() -> dict[str, Any]:
    holder, main = containers(NEW)  # the chart upgraded: the template names the new image
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {
            "name": DS_NAME,
            "namespace": NS,
            "uid": "ds-uid",
            "labels": {**SELECTOR, au.LABEL: au.IN_PLACE},
        },
        "spec": {
            "selector": {"matchLabels": SELECTOR},
            "updateStrategy": {"type": "OnDelete"},
            "template": {
                "metadata": {"labels": SELECTOR},
                "spec": {"initContainers": holder, "containers": main},
            },
        },
    }


def agent_status(image: str, ready: bool = True) -> list[dict[str, Any]]:
    state = {"running": {"startedAt": "2026-01-01T00:00:00Z"}} if ready else {"waiting": {}}
    return [
        {"name": "agent", "image": image, "imageID": "", "ready": ready, "state": state},
        {"name": "node-driver-registrar", "image": "registrar:v2.13.0", "ready": True,
         "state": {"running": {}}},
    ]  # fmt: skip


def agent_pod(name: str, node: str) -> dict[str, Any]:
    holder, main = containers(OLD)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": SELECTOR,
            "annotations": {"kubectl.kubernetes.io/default-container": "agent"},
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "DaemonSet",
                    "name": DS_NAME,
                    "uid": "ds-uid",
                    "controller": True,
                }
            ],
        },
        "spec": {"nodeName": node, "initContainers": holder, "containers": main},
        "status": {
            "phase": "Running",
            "initContainerStatuses": [
                {"name": "holder", "image": OLD, "ready": True, "started": True}
            ],
            "containerStatuses": agent_status(OLD),
        },
    }


def stored(kmock: Any, name: str) -> dict[str, Any]:
    return copy.deepcopy(dict(kmock.objects[PODS, NS, name].raw))


def agent_image(kmock: Any, name: str) -> str:
    return str(stored(kmock, name)["spec"]["containers"][0]["image"])


def kubelet_restarts_agent(kmock: Any, name: str) -> None:
    """What the kubelet does after the image change: only the agent container restarts, and
    runs the image its spec names now."""
    image = agent_image(kmock, name)
    kmock.objects[PODS, NS, name].patch({"status": {"containerStatuses": agent_status(image)}})


def daemonset_events(kmock: Any) -> list[dict[str, Any]]:
    out = [dict(o.raw) for key, o in kmock.objects.items() if key[0] == "v1/events"]
    assert all(e["involvedObject"]["kind"] == "DaemonSet" for e in out)
    assert all(e["involvedObject"]["name"] == DS_NAME for e in out)
    return sorted(out, key=lambda e: e["metadata"]["name"])


def reasons(kmock: Any) -> list[tuple[str, str]]:
    return sorted((e["type"], e["reason"]) for e in daemonset_events(kmock))


async def test_agent_pods_are_upgraded_in_place_one_after_the_other(
    kmock: Any, tmp_path: Path
) -> None:
    kmock.resources[DAEMONSETS].kind = "DaemonSet"
    kmock.resources[DAEMONSETS].namespaced = True
    kmock.resources[DAEMONSETS].verbs = {"get", "list"}
    put(kmock, DAEMONSETS, daemonset())
    before = {n: put(kmock, PODS, agent_pod(n, node)) for n, node in (("a", "n1"), ("b", "n2"))}
    async with running_operator(
        kmock, tmp_path, webhook_port=0, pod_namespace=NS, agent_daemonset=DS_NAME,
        agent_upgrade_interval=0.2, agent_upgrade_timeout=2.0,
    ):  # fmt: skip
        # the first pod (by node) is patched; the second waits while the first is not back
        await eventually(lambda: agent_image(kmock, "a") == NEW)
        progress = json.loads(stored(kmock, "a")["metadata"]["annotations"][au.ANNOTATION])
        assert progress["image"] == NEW and progress["since"]
        await asyncio.sleep(1.0)  # five rounds
        assert agent_image(kmock, "b") == OLD and daemonset_events(kmock) == []
        # not back within 2 s: a Warning on the DaemonSet, once; still nothing else patched
        await eventually(lambda: reasons(kmock) == [("Warning", "AgentUpgradeStalled")])
        (stall,) = daemonset_events(kmock)
        assert "pod a on node n1" in stall["message"] and NEW in stall["message"]
        await asyncio.sleep(0.6)
        assert agent_image(kmock, "b") == OLD and len(daemonset_events(kmock)) == 1

        # the agent container comes back with the new image: announced, then the next pod
        kubelet_restarts_agent(kmock, "a")
        await eventually(lambda: agent_image(kmock, "b") == NEW)
        kubelet_restarts_agent(kmock, "b")
        await eventually(lambda: len(daemonset_events(kmock)) == 3)
        assert reasons(kmock) == [("Normal", "AgentUpgraded"), ("Normal", "AgentUpgraded"),
                                  ("Warning", "AgentUpgradeStalled")]  # fmt: skip
        upgraded = sorted(e["message"] for e in daemonset_events(kmock) if e["type"] == "Normal")
        assert upgraded[0].startswith(f"pod a on node n1: the agent container runs {NEW}")
        assert upgraded[1].startswith(f"pod b on node n2: the agent container runs {NEW}")
        await asyncio.sleep(0.6)  # done: no more patches or events
        assert len(daemonset_events(kmock)) == 3

    for name, old in before.items():
        new = stored(kmock, name)
        assert new["spec"]["containers"][0] == {**old["spec"]["containers"][0], "image": NEW}
        assert new["spec"]["containers"][1:] == old["spec"]["containers"][1:]  # the registrar
        assert new["spec"]["initContainers"] == old["spec"]["initContainers"]  # the holder
        assert {k: v for k, v in new["spec"].items() if k != "containers"} == {
            k: v for k, v in old["spec"].items() if k != "containers"
        }
        progress = json.loads(new["metadata"]["annotations"][au.ANNOTATION])
        assert progress["image"] == NEW and progress["done"]
        # every stored version of the pod kept the holder (no patch ever reached it)
        history = list(kmock.objects[PODS, NS, name].history)
        assert len(history) >= 4 and None not in history  # patched and marked, never deleted
        assert all(v["spec"]["initContainers"] == old["spec"]["initContainers"] for v in history)
    # every request kmock served (it iterates over them): the operator read the DaemonSet and
    # patched pods; it never deleted, created or replaced a pod, and wrote nothing to the DaemonSet
    calls = {(r.method.value, r.resource.plural) for r in kmock
             if r.resource is not None and r.resource.plural in ("daemonsets", "pods")}  # fmt: skip
    assert calls == {("GET", "daemonsets"), ("GET", "pods"), ("PATCH", "pods")}
