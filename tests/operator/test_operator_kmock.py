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
    free_port,
    put,
    running_operator,
)
from tests.sidecar.procs import sidecar_process, socket_dir

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
        kmock, tmp_path, webhook_port=0, status_interval=0.5, rollouts=True, **NO_LABEL_CHECK
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


def served_pod(name: str, port: int) -> dict[str, Any]:
    """An injected, running pod whose sidecar answers Stats on 127.0.0.1:<port> (a real sidecar
    process of the test: the pod's IP and its declared grpc-health port point there)."""
    body = pod(name, {"app": "vllm"}, injected_by="cache", sidecar_ready=True)
    body["metadata"]["uid"] = f"uid-{name}"
    body["metadata"]["annotations"][ann.STATUS] = json.dumps(
        {"policy": "cache", "vllmContainer": "vllm"}
    )
    body["status"]["podIP"] = "127.0.0.1"
    body["spec"]["initContainers"] = [
        {
            "name": SIDECAR_NAME,
            "image": "kvoffload:1",
            "restartPolicy": "Always",
            "ports": [{"name": "grpc-health", "containerPort": port, "protocol": "TCP"}],
        }
    ]
    return body


def degraded_status(kmock: Any, expected: str) -> Any:
    status = status_of(kmock, "cache")
    return condition(status, "Degraded").get("status") == expected and status


async def test_a_sidecar_without_its_pool_degrades_the_policy_until_the_pod_goes(
    kmock: Any, tmp_path: Path
) -> None:
    """A real sidecar that cannot build its pool (NUMA node 999, --on-pool-error degrade) answers
    Stats with its reason: Degraded=True PoolUnavailable, one Event; the pod goes: it clears."""
    port = free_port()
    put(kmock, POLICIES, policy("cache"))
    put(kmock, PODS, served_pod("nopool", port))
    put(kmock, PODS, served_pod("dark", free_port()))  # nothing listens: unreachable, no cause
    with (
        socket_dir() as sock_dir,
        sidecar_process(
            tmp_path,
            sock_dir,
            "--on-pool-error=degrade",
            "--numa-node=999",
            f"--listen=127.0.0.1:{port}",
            ready_timeout=20,
        ),
    ):
        async with running_operator(
            kmock, tmp_path, webhook_port=0, status_interval=0.3, **NO_LABEL_CHECK
        ) as op:
            status = await eventually(lambda: degraded_status(kmock, "True"))
            degraded = condition(status, "Degraded")
            assert degraded["reason"] == "PoolUnavailable"
            assert degraded["message"].startswith(
                "1 injected pod(s) serve without the kvoffload pool: nopool (PoolUnavailable: "
            )
            assert "999" in degraded["message"] and "dark" not in degraded["message"]
            assert status["degradedPods"] == 1
            assert status["degradedReasons"] == {"PoolUnavailable": 1}
            assert status["unreachableSidecars"] == 1
            (event,) = await eventually(lambda: events(kmock))
            assert event["reason"] == "KVOffloadPoolUnavailable" and event["type"] == "Warning"
            assert event["involvedObject"]["name"] == "nopool"
            assert event["involvedObject"]["fieldPath"] == "spec.initContainers{kvoffload-sidecar}"
            assert "serves without a pool" in event["message"] and "999" in event["message"]
            await asyncio.sleep(1.0)  # several timer rounds: still one event
            assert len(events(kmock)) == 1

            await asyncio.to_thread(
                client.CoreV1Api(op.api.api).delete_namespaced_pod,
                "nopool",
                NS,
                _request_timeout=(5, 10),
                _preload_content=False,  # the stored pod is no full Pod model (no images)
            )
            status = await eventually(lambda: degraded_status(kmock, "False"))
            assert (status["degradedPods"], status["degradedReasons"]) == (0, {})


async def test_a_disabled_connector_degrades_the_policy_until_it_is_active(
    kmock: Any, tmp_path: Path
) -> None:
    """A healthy sidecar relays the connector's status file (state disabled): Degraded=True
    ConnectorDisabled and one Event on the vLLM container; the connector turns active: cleared."""
    port = free_port()
    put(kmock, POLICIES, policy("cache"))
    put(kmock, PODS, served_pod("mamba", port))
    with (
        socket_dir() as sock_dir,
        sidecar_process(tmp_path, sock_dir, f"--listen=127.0.0.1:{port}", ready_timeout=20),
    ):
        status_file = sock_dir / "connector-status-scheduler-0.json"
        entry = {
            "state": "disabled",
            "reason": "unsupported model: SSM/Mamba layers",
            "role": "scheduler",
            "rank": 0,
            "vllm_version": "0.32.0",
            "pid": 1,
            "time": "2026-01-01T00:00:00Z",
        }
        status_file.write_text(json.dumps(entry))
        async with running_operator(
            kmock, tmp_path, webhook_port=0, status_interval=0.3, **NO_LABEL_CHECK
        ):
            status = await eventually(lambda: degraded_status(kmock, "True"))
            degraded = condition(status, "Degraded")
            assert degraded["reason"] == "ConnectorDisabled"
            assert (
                "mamba (ConnectorDisabled: scheduler rank 0: unsupported model: SSM/Mamba"
                in (degraded["message"])
            )
            assert status["degradedReasons"] == {"ConnectorDisabled": 1}
            assert status["unreachableSidecars"] == 0
            # the sidecar's pool (16Mi, nothing stored) in the status and `kubectl get` columns
            assert (status["poolCapacityBytes"], status["poolUsedBytes"]) == (16 << 20, 0)
            assert (status["poolCapacity"], status["poolUsed"]) == ("16Mi", "0")
            (event,) = await eventually(lambda: events(kmock))
            assert event["reason"] == "KVOffloadConnectorDisabled"
            assert event["involvedObject"]["fieldPath"] == "spec.containers{vllm}"
            assert "SSM/Mamba" in event["message"]

            status_file.write_text(json.dumps({**entry, "state": "active", "reason": ""}))
            status = await eventually(lambda: degraded_status(kmock, "False"))
            assert (status["degradedPods"], status["degradedReasons"]) == (0, {})
            assert len(events(kmock)) == 1
