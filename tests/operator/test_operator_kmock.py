"""The operator loop against the kmock API emulator: policy status, rollouts, conflicts,
deletion. Final state is asserted (kmock may deliver an event twice; counts of calls mean
nothing there)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kvoffload_operator import annotations as ann
from kvoffload_operator.inject import SIDECAR_NAME
from kvoffload_operator.policy import policy_from_resource

from tests.operator.harness import (
    POLICIES,
    decoded_patch,
    eventually,
    put,
    running_operator,
)

pytestmark = pytest.mark.process

NS = "team"
DEPLOYMENTS, STATEFULSETS, PODS = "apps/v1/deployments", "apps/v1/statefulsets", "v1/pods"


def policy(
    name: str,
    size: str = "8Gi",
    priority: int = 0,
    rollout: bool = True,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    return {
        "apiVersion": "kvoffload.io/v1alpha1",
        "kind": "KVOffloadPolicy",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "selector": {"matchLabels": labels or {"app": "vllm"}},
            "pool": {"size": size},
            "priority": priority,
            "rollout": {"enabled": rollout},
        },
    }


def workload(kind: str, name: str, labels: dict[str, str], command: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": kind,
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "vllm", "image": "vllm:1", "command": command}]},
            },
        },
    }


def pod(
    name: str, labels: dict[str, str], injected_by: str | None = None, sidecar_ready: bool = False
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": NS, "labels": labels}
    status: dict[str, Any] = {"phase": "Running"}
    if injected_by:
        meta["annotations"] = {
            ann.STATUS: json.dumps({"policy": injected_by}),
            ann.POLICY: injected_by,
        }
        status["initContainerStatuses"] = [
            {"name": SIDECAR_NAME, "started": True, "ready": sidecar_ready}
        ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "status": status,
        "spec": {"containers": [{"name": "vllm", "image": "vllm:1"}]},
    }


# kmock cannot serve /api/v1/namespaces[/name] (its URL parser takes "namespaces/<x>" for a
# namespace prefix), so namespaces are unreadable there: the label check is unit-tested
# (test_settings.py) and these tests either turn it off (--injection-label="") or rely on an
# unreadable namespace counting as not opted in.
NO_LABEL_CHECK = {"injection_label": ""}


def current(kmock: Any, resource: str, name: str) -> dict[str, Any]:
    return dict(kmock.objects[resource, NS, name].raw)


def status_of(kmock: Any, name: str) -> dict[str, Any]:
    return dict(current(kmock, POLICIES, name).get("status") or {})


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), {})


def template_hash(kmock: Any, resource: str, name: str) -> str | None:
    template = current(kmock, resource, name)["spec"]["template"]
    return (template["metadata"].get("annotations") or {}).get(ann.POLICY_HASH)


async def test_status_and_rollout(kmock: Any, tmp_path: Path) -> None:
    spec = put(kmock, POLICIES, policy("cache"))
    vllm = {"app": "vllm"}
    put(kmock, DEPLOYMENTS, workload("Deployment", "llama", vllm, ["vllm", "serve", "m"]))
    put(kmock, STATEFULSETS, workload("StatefulSet", "mistral", vllm, ["vllm", "serve", "m"]))
    put(kmock, DEPLOYMENTS, workload("Deployment", "web", {"app": "web"}, ["nginx"]))
    put(
        kmock,
        DEPLOYMENTS,
        workload("Deployment", "wrapped", vllm, ["sh", "-c", "vllm serve a & vllm serve b"]),
    )
    put(kmock, PODS, pod("ready", vllm, injected_by="cache", sidecar_ready=True))
    put(kmock, PODS, pod("starting", vllm, injected_by="cache", sidecar_ready=False))
    put(kmock, PODS, pod("old", vllm))  # created before the policy: matched, not injected
    put(kmock, PODS, pod("web-1", {"app": "web"}))
    expected_hash = policy_from_resource(spec).spec_hash

    async with running_operator(
        kmock, tmp_path, webhook_port=0, status_interval=0.5, **NO_LABEL_CHECK
    ):
        status = await eventually(
            lambda: status_of(kmock, "cache").get("matchedPods") == 3 and status_of(kmock, "cache")
        )
        assert (status["injectedPods"], status["readySidecars"]) == (2, 1)
        assert status["observedGeneration"] == 1 and status["policyHash"] == expected_hash
        ready = condition(status, "Ready")
        assert (ready["status"], ready["reason"]) == ("True", "Applied")
        assert ready["message"] == "3 pods matched, 2 injected, 1 sidecars ready"
        assert condition(status, "Conflicting")["status"] == "False"
        await eventually(lambda: template_hash(kmock, DEPLOYMENTS, "llama") == expected_hash)
        await eventually(lambda: template_hash(kmock, STATEFULSETS, "mistral") == expected_hash)
        # not selected, or new pods would be skipped anyway (two engines in a shell): left alone
        assert template_hash(kmock, DEPLOYMENTS, "web") is None
        assert template_hash(kmock, DEPLOYMENTS, "wrapped") is None

        # the sidecar becomes ready: the timer picks it up
        put(kmock, PODS, pod("starting", vllm, injected_by="cache", sidecar_ready=True))
        await eventually(lambda: status_of(kmock, "cache").get("readySidecars") == 2)


async def test_namespace_not_opted_in_rolls_nothing(kmock: Any, tmp_path: Path) -> None:
    put(kmock, POLICIES, policy("quiet"))
    put(
        kmock, DEPLOYMENTS, workload("Deployment", "llama", {"app": "vllm"}, ["vllm", "serve", "m"])
    )
    async with running_operator(kmock, tmp_path, webhook_port=0, status_interval=0.5):
        status = await eventually(lambda: condition(status_of(kmock, "quiet"), "Ready"))
        assert (status["status"], status["reason"]) == ("False", "InjectionDisabled")
        assert template_hash(kmock, DEPLOYMENTS, "llama") is None


async def test_rollout_disabled_rolls_nothing(kmock: Any, tmp_path: Path) -> None:
    put(kmock, POLICIES, policy("still", rollout=False))
    put(
        kmock, DEPLOYMENTS, workload("Deployment", "llama", {"app": "vllm"}, ["vllm", "serve", "m"])
    )
    async with running_operator(
        kmock, tmp_path, webhook_port=0, status_interval=0.5, **NO_LABEL_CHECK
    ):
        status = await eventually(lambda: condition(status_of(kmock, "still"), "Ready"))
        assert status["status"] == "True"
        assert template_hash(kmock, DEPLOYMENTS, "llama") is None


async def test_conflicting_policies_get_a_condition(kmock: Any, tmp_path: Path) -> None:
    put(kmock, POLICIES, policy("alpha", size="4Gi"))
    put(kmock, POLICIES, policy("beta", size="64Gi"))  # same priority: alpha wins by name
    put(kmock, POLICIES, policy("gold", size="128Gi", priority=5, labels={"tier": "gold"}))
    put(kmock, PODS, pod("p1", {"app": "vllm"}))
    put(kmock, PODS, pod("p2", {"app": "vllm", "tier": "gold"}))
    async with running_operator(
        kmock, tmp_path, webhook_port=0, status_interval=0.5, **NO_LABEL_CHECK
    ):
        beta = await eventually(lambda: condition(status_of(kmock, "beta"), "Conflicting"))
        assert (beta["status"], beta["reason"]) == ("True", "PriorityTie")
        assert "alpha" in beta["message"] and "gold" in beta["message"]
        alpha = await eventually(lambda: condition(status_of(kmock, "alpha"), "Conflicting"))
        assert (alpha["status"], alpha["reason"]) == ("True", "LowerPriority")  # p2 → gold
        gold = await eventually(lambda: condition(status_of(kmock, "gold"), "Conflicting"))
        assert gold["status"] == "False"


@pytest.mark.parametrize("held", [False, True], ids=["released", "held-by-another-finalizer"])
async def test_deleting_a_policy_stops_injection_and_keeps_pods(
    kmock: Any, tmp_path: Path, held: bool
) -> None:
    """Injection stops once the policy is marked for deletion, even while another controller's
    finalizer keeps the object (and without waiting for kopf to release its own)."""
    doomed = policy("cache")
    if held:
        doomed["metadata"]["finalizers"] = ["audit.example.com/hold"]
    put(kmock, POLICIES, doomed)
    running = put(
        kmock, PODS, pod("ready", {"app": "vllm"}, injected_by="cache", sidecar_ready=True)
    )
    new_pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"labels": {"app": "vllm"}},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v1"}]},
    }
    async with running_operator(kmock, tmp_path, status_interval=0.5, **NO_LABEL_CHECK) as op:

        async def injects() -> bool:
            return bool(decoded_patch(await asyncio.to_thread(op.review, new_pod, NS)))

        await eventually(injects)
        await eventually(lambda: status_of(kmock, "cache").get("injectedPods") == 1)
        api = client.CustomObjectsApi(op.api.api)
        await asyncio.to_thread(
            api.delete_namespaced_custom_object,
            "kvoffload.io",
            "v1alpha1",
            NS,
            "kvoffloadpolicies",
            "cache",
            _request_timeout=(5, 10),
        )

        async def stopped() -> bool:
            return not await injects()

        await eventually(stopped)
        if held:  # still stored, marked for deletion: the webhook ignores it anyway
            assert current(kmock, POLICIES, "cache")["metadata"]["deletionTimestamp"]
        assert current(kmock, PODS, "ready")["metadata"] == running["metadata"]
        assert current(kmock, PODS, "ready")["spec"] == running["spec"]


def failing_pod(name: str, reason: str, skip: str | None = None) -> dict[str, Any]:
    body = pod(name, {"app": "vllm"}, injected_by=None if skip else "cache")
    if skip:
        body["metadata"]["annotations"] = {ann.SKIP_REASON: skip}
        return body
    body["metadata"]["uid"] = f"uid-{name}"
    body["status"]["initContainerStatuses"] = [
        {
            "name": SIDECAR_NAME,
            "started": False,
            "ready": False,
            "state": {"waiting": {"reason": reason, "message": "pull access denied"}},
        }
    ]
    return body


def events(kmock: Any) -> list[dict[str, Any]]:
    return [dict(o.raw) for key, o in kmock.objects.items() if key[0] == "v1/events"]


async def test_failing_sidecars_degrade_the_policy_and_get_one_event(
    kmock: Any, tmp_path: Path
) -> None:
    put(kmock, POLICIES, policy("cache"))
    put(kmock, PODS, pod("fine", {"app": "vllm"}, injected_by="cache", sidecar_ready=True))
    put(kmock, PODS, failing_pod("pull", "ImagePullBackOff"))
    put(kmock, PODS, failing_pod("shelled", "", skip="shell-wrapper"))
    put(kmock, PODS, failing_pod("offload", "", skip="has-kv-offloading"))
    put(kmock, PODS, failing_pod("offload-2", "", skip="has-kv-offloading"))
    async with running_operator(
        kmock, tmp_path, webhook_port=0, status_interval=0.3, **NO_LABEL_CHECK
    ):
        status = await eventually(
            lambda: (
                condition(status_of(kmock, "cache"), "Degraded").get("status") == "True"
                and status_of(kmock, "cache")
            )
        )
        assert status["skipped"] == {"has-kv-offloading": 2, "shell-wrapper": 1}
        degraded = condition(status, "Degraded")
        assert degraded["reason"] == "ImagePullFailed"
        assert "pull (kvoffload-sidecar: ImagePullBackOff)" in degraded["message"]
        assert "fine" not in degraded["message"]
        posted = await eventually(lambda: events(kmock))
        (event,) = posted
        assert event["involvedObject"]["name"] == "pull" and event["type"] == "Warning"
        assert event["reason"] == "KVOffloadContainerFailing"
        assert "ImagePullBackOff (pull access denied)" in event["message"]
        await asyncio.sleep(1.0)  # several timer rounds: still one event for that pod and reason
        assert len(events(kmock)) == 1

        # the image gets fixed: the condition clears
        put(kmock, PODS, pod("pull", {"app": "vllm"}, injected_by="cache", sidecar_ready=True))
        await eventually(
            lambda: condition(status_of(kmock, "cache"), "Degraded").get("status") == "False"
        )
