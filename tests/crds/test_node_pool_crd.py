"""The KVOffloadNodePool CRD: its schema and CEL rules offline (crdschema.py's emulation), its
example read by the node agent's parser as the same grants, and the chart's copy the same file."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml
from kvoffload_sidecar.node.grants import load_spec, parse_node_pool

from tests.crds.crdschema import _VALIDATOR, ROOT, apply_defaults, cel_errors, to_jsonschema

CRD = ROOT / "crds" / "kvoffloadnodepool.yaml"
EXAMPLE = ROOT / "crds" / "examples" / "nodepool" / "two-teams.yaml"


def _schema() -> dict:
    return yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def validate(obj: dict) -> list[str]:
    schema = _schema()
    obj = apply_defaults(copy.deepcopy(obj), schema)
    errors = [
        f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
        for e in _VALIDATOR(to_jsonschema(schema)).iter_errors(obj)
    ]
    return errors or cel_errors(obj, schema)


def _example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def test_the_example_is_accepted_and_parses_to_the_same_grants() -> None:
    assert validate(_example()) == []
    pool = parse_node_pool(_example())
    assert [(t.name, t.share_bytes, t.namespaces, t.service_accounts) for t in pool.tenants] == [
        ("team-a", 512 << 30, ("team-a", "team-a-staging"), ()),
        ("team-b", 256 << 30, ("team-b",), ("vllm",)),
    ]
    assert load_spec(EXAMPLE) == pool  # the agent's --node-pool reads the object itself


@pytest.mark.parametrize(
    ("change", "expect"),
    [
        (lambda t: t.update(share="512Ki"), "at least 1Mi"),
        (lambda t: t.update(share="1.5Gi"), "does not match"),
        (lambda t: t.update(share="64GB"), "does not match"),
        (lambda t: t.update(namespaces=[]), "should be non-empty"),
        (lambda t: t.pop("namespaces"), "'namespaces' is a required property"),
        (lambda t: t.update(namespaces=["team-a", "team-a"]), "Duplicate value"),
        (lambda t: t.update(name="Team_A"), "does not match"),
        (lambda t: t.update(weight=2), "Additional properties are not allowed"),
    ],
)
def test_a_bad_tenant_is_refused_with_a_clear_message(change, expect: str) -> None:
    obj = _example()
    change(obj["spec"]["tenants"][0])
    errors = validate(obj)
    assert any(expect in e for e in errors), errors


def test_a_pool_without_tenants_is_refused() -> None:
    obj = _example()
    obj["spec"]["tenants"] = []
    assert any("should be non-empty" in e for e in validate(obj))


@pytest.mark.parametrize("version", ["1.29.0", "1.33.0"])
def test_the_crd_is_a_valid_cluster_object(version: str) -> None:
    kubernetes_validate.validate(yaml.safe_load(CRD.read_text()), version, strict=True)


def test_the_chart_carries_the_same_crd() -> None:
    copy_ = ROOT / "charts" / "kvoffload" / "crds" / CRD.name
    assert copy_.read_bytes() == CRD.read_bytes(), "run make crds-sync"


def test_the_crd_is_cluster_scoped_and_the_policy_examples_are_not_node_pools() -> None:
    assert yaml.safe_load(CRD.read_text())["spec"]["scope"] == "Cluster"
    # the policy tests read crds/examples/*.yaml as policies: node pool examples live below
    assert EXAMPLE.parent != ROOT / "crds" / "examples"


def test_the_status_entry_a_node_agent_writes_is_what_the_schema_keeps() -> None:
    """The agent's own entry (every field it writes) passes the status schema; unknown fields
    would be pruned by the API server, so the emulation refuses them."""
    from kvoffload_sidecar.node.follow import PoolFollower
    from kvoffload_sidecar.node.tenant_memory import TenantMemory

    obj = _example()
    memory = TenantMemory(parse_node_pool(obj))  # sparse memfds: nothing is faulted
    try:
        follower = PoolFollower(
            name="two-teams", node_id="node-a", pool_bytes=1 << 40, memory=memory,
            bindings=list, client=None,  # type: ignore[arg-type]  # no API call here
        )  # fmt: skip
        assert follower.apply({**obj, "metadata": {**obj["metadata"], "generation": 3}})
        entry = follower.status_entry()
    finally:
        memory.close()
    assert {c["type"] for c in entry["conditions"]} == {"Ready", "GrantsRejected"}
    assert validate({**obj, "status": {"nodes": {"node-a": entry}}}) == []
    bad = {**entry, "tenantsUsed": 2}
    assert validate({**obj, "status": {"nodes": {"node-a": bad}}}) != []
