"""Injected pods run under any uid and Pod Security "restricted", and never hold vLLM back long."""

from __future__ import annotations

from typing import Any

import pytest
from kvoffload_operator.inject import inject_pod
from kvoffload_operator.policy import PolicyError, policy_from_resource

from tests.operator.pss import restricted_violations


def policy(**spec: Any) -> Any:
    return policy_from_resource(
        {
            "kind": "KVOffloadPolicy",
            "metadata": {"name": "p"},
            "spec": {"selector": {}, "pool": {"size": "8Gi"}, **spec},
        }
    )


# a vLLM pod that itself meets "restricted", so every violation found is ours
RESTRICTED_VLLM = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "x"},
    "spec": {
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [
            {
                "name": "vllm",
                "image": "vllm/vllm-openai:v0.11.0",
                "args": ["--model", "m"],
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "capabilities": {"drop": ["ALL"]},
                },
            }
        ],
    },
}


def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]


@pytest.mark.parametrize(
    "spec",
    [
        {},
        {"pool": {"size": "8Gi", "hugepages": True}},
        {"connector": {"delivery": "preinstalled"}},
        {"sidecar": {"startupTimeoutSeconds": 60}},
    ],
    ids=["default", "hugepages", "preinstalled", "timeout"],
)
def test_injected_pods_pass_pod_security_restricted_and_pin_no_uid(spec: dict[str, Any]) -> None:
    assert restricted_violations(RESTRICTED_VLLM) == []
    out = inject_pod(RESTRICTED_VLLM, [policy(**spec)]).pod
    assert out["spec"]["initContainers"], "nothing injected"
    assert restricted_violations(out) == []
    for c in out["spec"]["initContainers"]:
        sc = c["securityContext"]
        # OpenShift's restricted SCC assigns a uid from the namespace's range: pinning one would
        # reject the whole pod, so only runAsNonRoot (the images' numeric USER 65532) is set
        assert "runAsUser" not in sc and "runAsGroup" not in sc, c["name"]
        assert sc["runAsNonRoot"] is True and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"]["drop"] == ["ALL"] and sc["allowPrivilegeEscalation"] is False


def test_the_checker_rejects_what_restricted_rejects() -> None:
    """Added capabilities and a privileged sidecar are found (the checker can fail)."""
    caps = inject_pod(RESTRICTED_VLLM, [policy(sidecar={"extraCapabilities": ["IPC_LOCK"]})]).pod
    assert any("capabilities.add" in v for v in restricted_violations(caps))
    priv = inject_pod(RESTRICTED_VLLM, [policy(sidecar={"securityProfile": "privileged"})]).pod
    assert any("privileged" in v for v in restricted_violations(priv))


def sidecar_of(pod: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod["spec"]["initContainers"] if c["name"] == "kvoffload-sidecar")


@pytest.mark.parametrize(("timeout", "deadline"), [(None, 5), (1, 1), (300, 300)])
def test_the_startup_probe_bounds_how_long_vllm_waits(timeout: int | None, deadline: int) -> None:
    spec = {} if timeout is None else {"sidecar": {"startupTimeoutSeconds": timeout}}
    sidecar = sidecar_of(inject_pod(RESTRICTED_VLLM, [policy(**spec)]).pod)
    probe = sidecar["startupProbe"]
    assert probe["exec"]["command"] == [
        "kvoffload",
        "probe",
        "--socket",
        "/kvoffload/run/pool.sock",
        "--deadline",
        str(deadline),
    ]
    assert (probe["periodSeconds"], probe["timeoutSeconds"]) == (1, 3)
    # the kubelet never gives up before the probe's own deadline passes
    assert probe["failureThreshold"] == deadline + 30
    assert "readinessProbe" not in sidecar  # a degraded sidecar keeps the pod in service
    assert (
        sidecar["livenessProbe"]["failureThreshold"] * sidecar["livenessProbe"]["periodSeconds"]
        >= 60
    )
    assert "--on-pool-error=degrade" in sidecar["args"]


@pytest.mark.parametrize("bad", [0, 301, "5", True])
def test_startup_timeout_is_validated(bad: Any) -> None:
    with pytest.raises(PolicyError, match="spec.sidecar.startupTimeoutSeconds"):
        policy(sidecar={"startupTimeoutSeconds": bad})


def test_chunk_size_is_injected_only_when_the_policy_sets_it() -> None:
    import json

    def extra(pol: Any) -> dict[str, Any]:
        vllm = inject_pod(RESTRICTED_VLLM, [pol]).pod["spec"]["containers"][0]
        return json.loads(vllm["args"][-1].split("=", 1)[1])["kv_connector_extra_config"]

    assert "chunk_size" not in extra(policy())
    assert extra(policy(offload={"chunkSize": 256}))["chunk_size"] == 256
    with pytest.raises(PolicyError, match="multiple of 16"):
        policy(offload={"chunkSize": 100})


@pytest.mark.process
def test_the_injected_probe_command_passes_by_its_deadline_without_a_sidecar(tmp_path) -> None:
    """The rendered exec probe, run as the kubelet would (every second, the installed
    `kvoffload` script), with no sidecar ever serving: it fails until the deadline, then passes."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    sidecar = sidecar_of(
        inject_pod(RESTRICTED_VLLM, [policy(sidecar={"startupTimeoutSeconds": 2})]).pod
    )
    command = list(sidecar["startupProbe"]["exec"]["command"])
    command[0] = str(Path(sys.executable).with_name("kvoffload"))
    command[command.index("--socket") + 1] = str(tmp_path / "pool.sock")
    start, codes = time.monotonic(), []
    while time.monotonic() - start < 10:
        res = subprocess.run(command, capture_output=True, text=True, timeout=3)
        codes.append((round(time.monotonic() - start, 1), res.returncode))
        if res.returncode == 0:
            break
        time.sleep(0.5)
    elapsed, last = codes[-1]
    assert last == 0 and codes[0][1] == 1, codes
    assert 2 <= elapsed < 4, codes  # well inside failureThreshold (deadline + 30 periods)
