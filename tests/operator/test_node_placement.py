"""``spec.pool.placement: node``: the policy's fields, the pod the injector writes (no sidecar,
the node agent's CSI volume, the connector's node settings) and its checks (the injector's own,
Pod Security "restricted", strict schemas of the oldest and newest Kubernetes). The policy
status is in test_node_status.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kvoffload_operator import annotations as ann
from kvoffload_operator import hashseed
from kvoffload_operator.inject import SIDECAR_NAME, SkipReason, inject_pod
from kvoffload_operator.inject.render import INSTALLER_NAME, kv_transfer_config
from kvoffload_operator.inject.verify import intent_of, verify
from kvoffload_operator.policy import Placement, PolicyError, policy_from_resource

from tests.operator.pss import restricted_violations
from tests.operator.test_injected_property import FIXTURES, chart_versions
from tests.operator.test_pod_security_probes import RESTRICTED_VLLM

ROOT = Path(__file__).resolve().parents[2]
NODE_POOL = {"placement": "node", "nodePool": "gpu-nodes", "tenant": "team-a"}
CSI = {"driver": "node.kvoffload.io", "readOnly": False, "volumeAttributes": {"tenant": "team-a"}}
CSI_VOLUME = {"name": "kvoffload-node", "csi": CSI}


def policy(pool: dict[str, Any] | None = None, **spec: Any) -> Any:
    return policy_from_resource(
        {
            "kind": "KVOffloadPolicy",
            "metadata": {"name": "p", "namespace": "ns", "generation": 3},
            "spec": {"selector": {}, "pool": pool or NODE_POOL, **spec},
        }
    )


def vllm_pod(**spec: Any) -> dict[str, Any]:
    pod = copy.deepcopy(RESTRICTED_VLLM)
    pod["metadata"]["labels"] = {"app": "vllm"}
    pod["spec"].update(spec)
    return pod


def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]


# -- the policy ----------------------------------------------------------------------------------
def test_the_policy_carries_placement_node_pool_and_tenant() -> None:
    node = policy().pool
    assert (node.placement, node.node_pool, node.tenant) == (Placement.NODE, "gpu-nodes", "team-a")
    assert node.node and (node.size, node.size_bytes) == ("", 0)
    pod = policy({"size": "8Gi"}).pool
    assert (pod.placement, pod.node_pool, pod.tenant, pod.node) == (
        Placement.POD,
        None,
        None,
        False,
    )


def test_pod_placement_hashes_are_those_of_policies_written_before_placement() -> None:
    """The operator stamps spec_hash on workload templates: a changed hash rolls them all, so an
    upgrade must not change a pod-placement policy's (the values were computed before the
    placement fields existed)."""
    for name, expected in (("minimal", "ea7c213fc0540ade"), ("full", "0d90be3365174b3f")):
        raw = yaml.safe_load((ROOT / "crds" / "examples" / f"{name}.yaml").read_text())
        assert policy_from_resource(raw).spec_hash == expected, name
        raw["spec"]["pool"]["placement"] = "pod"  # written out: the same policy
        assert policy_from_resource(raw).spec_hash == expected, name
    # a node policy hashes its tenant: moving pods to another tenant rolls them
    assert policy().spec_hash != policy({**NODE_POOL, "tenant": "team-b"}).spec_hash
    # a size is ignored with node, so writing one rolls nothing
    assert policy().spec_hash == policy({**NODE_POOL, "size": "64Gi"}).spec_hash


@pytest.mark.parametrize(
    ("pool", "spec", "words"),
    [
        ({"placement": "node", "tenant": "team-a"}, {}, "required with placement node"),
        ({"size": "8Gi", "nodePool": "gpu-nodes"}, {}, "used only with placement node"),
        ({"size": "8Gi", "placement": "pod", "tenant": "t"}, {}, "used only with placement node"),
        ({**NODE_POOL, "numaNode": 0}, {}, "are for placement pod"),
        ({**NODE_POOL, "hugepages": True}, {}, "are for placement pod"),
        ({**NODE_POOL, "eviction": "arc"}, {}, "are for placement pod"),
        (NODE_POOL, {"sidecar": {"resources": {}}}, "placement node injects no pool sidecar"),
        (NODE_POOL, {"sidecar": {"extraCapabilities": ["IPC_LOCK"]}}, "injects no pool sidecar"),
        (NODE_POOL, {"tenants": [{"name": "a", "cacheSalts": ["a"]}]}, "tenants are for"),
        (NODE_POOL, {"connector": {"extraConfig": {"placement": "pod"}}}, "or placement"),
        ({"placement": "cluster", "size": "8Gi"}, {}, "is not one of: pod, node"),
        ({**NODE_POOL, "tenant": 7}, {}, "must be a string"),
    ],
)
def test_what_node_placement_refuses(
    pool: dict[str, Any], spec: dict[str, Any], words: str
) -> None:
    with pytest.raises(PolicyError, match=words.replace("(", r"\(")):
        policy(pool, **spec)


def test_what_node_placement_ignores() -> None:
    """Defaults the API server writes (sidecar profile and timeout, eviction lru) and a size are
    accepted: the tenant's share is the memory, and there is no sidecar to time."""
    p = policy(
        {**NODE_POOL, "size": "64Gi", "eviction": "lru", "hugepages": False},
        sidecar={"securityProfile": "minimal", "startupTimeoutSeconds": 60, "image": ""},
    )
    out = inject_pod(vllm_pod(), [p]).pod
    assert [c["name"] for c in out["spec"]["initContainers"]] == [INSTALLER_NAME]
    assert "64Gi" not in json.dumps(out) and str(64 << 30) not in json.dumps(out)


# -- the injected pod ----------------------------------------------------------------------------
def test_node_placement_adds_the_csi_volume_and_no_sidecar() -> None:
    p = policy(offload={"mode": "lazy", "chunkSize": 256})
    result = inject_pod(vllm_pod(), [p])
    assert result.decision.inject and result.decision.pool_bytes is None
    out = result.pod
    names = [c["name"] for c in containers(out)]
    assert SIDECAR_NAME not in names and names == [INSTALLER_NAME, "vllm"]
    assert out["spec"]["volumes"] == [
        CSI_VOLUME,
        {"name": "kvoffload-python", "emptyDir": {"sizeLimit": "1Gi"}},
    ]
    for c in containers(out):  # nothing of the sidecar: no ports, probes or pool paths
        assert not c.get("ports") and not c.get("startupProbe") and not c.get("livenessProbe")
        assert not any(m["mountPath"].startswith("/kvoffload/pool") for m in c["volumeMounts"])
    vllm = out["spec"]["containers"][0]
    assert vllm["volumeMounts"] == [
        {"name": "kvoffload-node", "mountPath": "/var/run/kvoffload"},  # read-write
        {"name": "kvoffload-python", "mountPath": "/kvoffload/python", "readOnly": True},
    ]
    (flag,) = [a for a in vllm["args"] if a.startswith("--kv-transfer-config=")]
    extra = json.loads(flag.split("=", 1)[1])["kv_connector_extra_config"]
    assert extra == {
        "socket": "/var/run/kvoffload/pool.sock",
        "placement": "node",
        "mode": "lazy",
        "load_mode": "layered",
        "chunk_size": 256,
    }
    status = json.loads(out["metadata"]["annotations"][ann.STATUS])
    assert status["initContainers"] == [INSTALLER_NAME]
    assert status["volumes"] == ["kvoffload-node", "kvoffload-python"]
    assert (status["placement"], status["nodePool"], status["tenant"]) == (
        "node",
        "gpu-nodes",
        "team-a",
    )


def test_the_installer_and_the_environment_are_those_of_pod_placement() -> None:
    node = inject_pod(vllm_pod(), [policy()]).pod
    pod = inject_pod(vllm_pod(), [policy({"size": "8Gi"})]).pod
    assert node["spec"]["initContainers"][0] == pod["spec"]["initContainers"][0]
    assert node["spec"]["containers"][0]["env"] == pod["spec"]["containers"][0]["env"]
    env = {e["name"]: e for e in node["spec"]["containers"][0]["env"]}
    assert env[hashseed.KEY] == hashseed.env_entry("p")  # the policy's seed Secret
    assert env["PYTHONPATH"]["value"] == "/kvoffload/python"
    assert (
        "placement" not in kv_transfer_config(policy({"size": "8Gi"}))["kv_connector_extra_config"]
    )


@pytest.mark.parametrize(
    "spec", [{}, {"connector": {"delivery": "preinstalled"}}], ids=["installer", "preinstalled"]
)
def test_the_injected_pod_passes_restricted_and_the_injectors_checks(spec: dict[str, Any]) -> None:
    original = vllm_pod()
    assert restricted_violations(original) == []
    result = inject_pod(original, [policy(**spec)])
    out = result.pod
    assert restricted_violations(out) == []
    assert verify(original, out, intent_of(result.decision)).ok
    assert not any(key in out["spec"] for key in ("hostIPC", "hostPID", "hostNetwork"))
    assert not any("hostPath" in v for v in out["spec"]["volumes"])
    for c in containers(out):
        assert not (c.get("securityContext") or {}).get("capabilities", {}).get("add")
    if spec:  # preinstalled: the volume and the flag, nothing else
        assert "initContainers" not in out["spec"]
        assert out["spec"]["volumes"] == [CSI_VOLUME]
    # the checker can fail: a hostPath is what node mode must never add
    bad = copy.deepcopy(out)
    bad["spec"]["volumes"].append({"name": "h", "hostPath": {"path": "/var/lib/kubelet"}})
    assert any("hostPath" in v for v in restricted_violations(bad))


def test_verification_holds_the_node_config() -> None:
    """The webhook's own check compares the flag with the node config: the pod-mode socket in
    a node pod is a failure."""
    original = vllm_pod()
    result = inject_pod(original, [policy()])
    bad = copy.deepcopy(result.pod)
    args = bad["spec"]["containers"][0]["args"]
    args[-1] = args[-1].replace("/var/run/kvoffload/pool.sock", "/kvoffload/run/pool.sock")
    verdict = verify(original, bad, intent_of(result.decision))
    assert [f.check for f in verdict.failures] == ["flag-json"]


@pytest.mark.parametrize("version", chart_versions())
def test_the_injected_pod_is_valid_at_the_oldest_and_newest_kubernetes(version: str) -> None:
    for spec in ({}, {"connector": {"delivery": "preinstalled"}}):
        out = inject_pod(vllm_pod(), [policy(**spec)]).pod
        kubernetes_validate.validate(out, version, strict=True)
    # the validation can fail: a csi volume without its driver
    bad = inject_pod(vllm_pod(), [policy()]).pod
    del bad["spec"]["volumes"][0]["csi"]["driver"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, version, strict=True)


def test_host_network_and_the_pool_size_annotation() -> None:
    """Node placement adds no ports (hostNetwork is no skip) and no pool of the pod's own
    (kvoffload.io/pool-size, even one pod placement refuses, is ignored)."""
    pod = vllm_pod(hostNetwork=True)
    pod["metadata"]["annotations"] = {ann.POOL_SIZE: "lots"}
    assert inject_pod(pod, [policy()]).decision.inject
    for_pod = inject_pod(pod, [policy({"size": "8Gi"})]).decision
    assert for_pod.reason is SkipReason.HOST_NETWORK
    del pod["spec"]["hostNetwork"]
    assert inject_pod(pod, [policy({"size": "8Gi"})]).decision.reason is SkipReason.INVALID_OVERRIDE


@pytest.mark.parametrize("pool", [NODE_POOL, {"size": "8Gi"}], ids=["node", "pod"])
def test_a_pod_that_already_has_the_node_volume_is_hand_wired(pool: dict[str, Any]) -> None:
    wired = vllm_pod(volumes=[{**CSI_VOLUME, "name": "mine"}])
    decision = inject_pod(wired, [policy(pool)]).decision
    assert decision.reason is SkipReason.HAND_WIRED and "node.kvoffload.io" in decision.message
    mounted = vllm_pod(volumes=[{"name": "run", "emptyDir": {}}])
    mounted["spec"]["containers"][0]["volumeMounts"] = [
        {"name": "run", "mountPath": "/var/run/kvoffload/"}
    ]
    decision = inject_pod(mounted, [policy(pool)]).decision
    assert decision.reason is SkipReason.HAND_WIRED and "/var/run/kvoffload" in decision.message


def test_a_guaranteed_pod_stays_guaranteed_and_its_pod_level_budget_is_not_grown() -> None:
    """Nothing injected holds the pool (the node agent's holder does): pod-level resources stay
    as written, and the installer's limits equal its requests."""
    pod = vllm_pod()
    quantities = {"cpu": "4", "memory": "16Gi"}
    pod["spec"]["containers"][0]["resources"] = {"requests": quantities, "limits": quantities}
    pod["spec"]["resources"] = {"requests": quantities, "limits": quantities}
    out = inject_pod(pod, [policy()]).pod
    assert out["spec"]["resources"] == pod["spec"]["resources"]
    (installer,) = out["spec"]["initContainers"]
    assert installer["resources"]["requests"] == installer["resources"]["limits"]
    status = json.loads(out["metadata"]["annotations"][ann.STATUS])
    assert status["qos"] == "Guaranteed" and "podResources" not in status


def test_the_property_test_runs_over_node_placement_fixtures() -> None:
    """test_injected_property checks every fixture (structure, delivery, both schemas, the
    execution): the node-placement golden cases are among them, and they inject."""
    node = [fx for fx in FIXTURES if any(p.pool.node for p in fx.policies)]
    cases = {fx.id.split("/")[1] for fx in node}
    assert {"deployment-node-placement", "pod-node-placement-preinstalled"} <= cases
    for fx in node:
        result = inject_pod(fx.template, fx.policies, group_size=fx.group_size)
        assert result.decision.inject, fx.id
        assert json.loads(result.pod["metadata"]["annotations"][ann.STATUS])["placement"] == "node"


def test_injecting_twice_changes_nothing() -> None:
    once = inject_pod(vllm_pod(), [policy()]).pod
    again = inject_pod(once, [policy()])
    assert again.decision.reason is SkipReason.ALREADY_INJECTED and again.patch == []
