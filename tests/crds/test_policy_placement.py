"""``spec.pool.placement``: the CRD (schema and CEL, evaluated offline) and policy.py refuse and
accept the same policies, each refusal in the CRD's words, case by case of every rule's parts."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from kvoffload_operator.policy import PolicyError, policy_from_resource

from tests.crds.crdschema import validate

NODE = {"placement": "node", "nodePool": "gpu-nodes", "tenant": "team-a"}


def obj(pool: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvoffload.io/v1alpha1",
        "kind": "KVOffloadPolicy",
        "metadata": {"name": "p", "namespace": "team-a"},
        "spec": {"selector": {"matchLabels": {"app": "vllm"}}, "pool": pool, **spec},
    }


REFUSED = [
    ("pod-without-size", obj({"placement": "pod"})),
    ("default-without-size", obj({"eviction": "arc"})),
    ("node-without-node-pool", obj({"placement": "node", "tenant": "team-a"})),
    ("node-without-anything", obj({"placement": "node"})),
    ("pod-with-node-pool", obj({"size": "8Gi", "nodePool": "gpu-nodes"})),
    ("pod-with-tenant", obj({"size": "8Gi", "placement": "pod", "tenant": "team-a"})),
    ("node-hugepages", obj({**NODE, "hugepages": True, "size": "2Mi"})),
    ("node-numa", obj({**NODE, "numaNode": 0})),
    ("node-arc", obj({**NODE, "eviction": "arc"})),
    ("node-sidecar-image", obj(NODE, sidecar={"image": "ghcr.io/a/b:1"})),
    ("node-sidecar-resources", obj(NODE, sidecar={"resources": {"requests": {"cpu": "1"}}})),
    ("node-sidecar-empty-resources", obj(NODE, sidecar={"resources": {}})),
    ("node-sidecar-caps", obj(NODE, sidecar={"extraCapabilities": ["IPC_LOCK"]})),
    ("node-privileged", obj(NODE, sidecar={"securityProfile": "privileged"})),
    ("node-tenants", obj(NODE, tenants=[{"name": "a", "cacheSalts": ["a"]}])),
    ("node-extra-placement", obj(NODE, connector={"extraConfig": {"placement": "pod"}})),
    ("pod-extra-placement", obj({"size": "8Gi"}, connector={"extraConfig": {"placement": "x"}})),
    ("node-size-zero", obj({**NODE, "size": "0"})),
]
ACCEPTED = [
    ("node", obj(NODE)),
    ("node-with-size", obj({**NODE, "size": "64Gi"})),
    ("node-defaults-written", obj({**NODE, "eviction": "lru", "hugepages": False})),
    (
        "node-sidecar-defaults",
        obj(NODE, sidecar={"securityProfile": "minimal", "startupTimeoutSeconds": 30, "image": ""}),
    ),
    ("node-empty-capabilities", obj(NODE, sidecar={"extraCapabilities": []})),
    (
        "node-connector-and-offload",
        obj(
            NODE,
            connector={"delivery": "preinstalled", "extraConfig": {"lookup_timeout_ms": "150"}},
            offload={"mode": "lazy", "loadMode": "async", "chunkSize": 256},
            vllmContainer={"name": "engine"},
            priority=5,
            rollout={"enabled": False},
        ),
    ),
    ("pod-explicit", obj({"placement": "pod", "size": "8Gi"})),
]


def _cel_messages(errors: list[str]) -> list[str]:
    return [e.split(": Invalid value: ", 1)[1] for e in errors if ": Invalid value: " in e]


@pytest.mark.parametrize("policy", [c[1] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_refused_by_the_crd_and_by_policy_py_in_its_words(policy: dict[str, Any]) -> None:
    _, errors = validate(copy.deepcopy(policy))
    cel = _cel_messages(errors)
    assert cel, errors  # every case is a CEL rule's (the schema alone would accept it)
    with pytest.raises(PolicyError) as exc:
        policy_from_resource(policy)
    assert any(m in str(exc.value) for m in cel), (str(exc.value), cel)


@pytest.mark.parametrize("policy", [c[1] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_accepted_by_the_crd_and_by_policy_py(policy: dict[str, Any]) -> None:
    defaulted, errors = validate(copy.deepcopy(policy))
    assert errors == []
    parsed = policy_from_resource(policy)
    assert policy_from_resource(defaulted) == parsed  # the API server's defaults change nothing
    pool = policy["spec"]["pool"]
    assert parsed.pool.placement.value == pool.get("placement", "pod")
    assert (parsed.pool.node_pool, parsed.pool.tenant) == (pool.get("nodePool"), pool.get("tenant"))


def test_placement_defaults_to_pod() -> None:
    defaulted, errors = validate(obj({"size": "8Gi"}))
    assert errors == [] and defaulted["spec"]["pool"]["placement"] == "pod"
    assert not policy_from_resource(obj({"size": "8Gi"})).pool.node
