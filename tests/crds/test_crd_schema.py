"""The CRD's schema and CEL rules, checked offline (see crdschema.py for what is emulated).

Good examples (crds/examples) must pass; each bad one (tests/crds/bad) must fail with the
message on its ``# expect:`` line, and `policy.py` (what the offline CLI uses) must reject it
too with its ``# python-expect:`` message.
"""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kvoffload_operator.policy import Policy, PolicyError, policy_from_resource

from tests.crds.crdschema import CRD_PATH, ROOT, load_crd, openapi_schema, validate

GOOD = sorted((ROOT / "crds" / "examples").glob("*.yaml"))
BAD = sorted((Path(__file__).parent / "bad").glob("*.yaml"))


def _header(path: Path, key: str) -> str:
    for line in path.read_text().splitlines():
        if line.startswith(f"# {key}: "):
            return line.split(": ", 1)[1].strip()
    raise AssertionError(f"{path.name} has no '# {key}:' line")


def test_there_are_examples_on_both_sides() -> None:
    assert len(GOOD) >= 4 and len(BAD) >= 12


@pytest.mark.parametrize("path", GOOD, ids=lambda p: p.name)
def test_good_example_is_accepted(path: Path) -> None:
    obj, errors = validate(yaml.safe_load(path.read_text()))
    assert errors == []
    policy = policy_from_resource(obj)
    assert policy.name == obj["metadata"]["name"]
    assert policy.pool.size_bytes > 0 or (policy.pool.node and policy.pool.tenant)


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.name)
def test_bad_example_is_rejected_with_a_clear_message(path: Path) -> None:
    obj = yaml.safe_load(path.read_text())
    _, errors = validate(obj)
    expected = _header(path, "expect")
    assert any(expected in e for e in errors), errors
    with pytest.raises(PolicyError) as exc:
        policy_from_resource(obj)
    assert _header(path, "python-expect") in str(exc.value)


def test_schema_defaults_equal_policy_defaults() -> None:
    """The API server's defaulting and policy.py's defaults must produce the same Policy."""
    raw = yaml.safe_load((ROOT / "crds/examples/minimal.yaml").read_text())
    defaulted, errors = validate(raw)
    assert errors == []
    # no chunkSize: a default would be injected and could disagree with the engine's block size
    assert defaulted["spec"]["offload"] == {"mode": "eager", "loadMode": "layered"}
    assert defaulted["spec"]["sidecar"]["startupTimeoutSeconds"] == 5
    assert defaulted["spec"]["connector"]["delivery"] == "initContainer"
    from_server: Policy = policy_from_resource(defaulted)
    from_file: Policy = policy_from_resource(raw)
    assert from_server == from_file


def _walk(schema: dict, path: str):
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")


def test_every_field_has_a_description() -> None:
    missing = [
        p
        for p, s in _walk(openapi_schema(), "")
        if "description" not in s and p not in (".metadata",)
    ]
    assert missing == []


def test_crd_shape() -> None:
    crd = load_crd()
    spec = crd["spec"]
    assert (spec["group"], spec["scope"], spec["names"]["kind"]) == (
        "kvoffload.io",
        "Namespaced",
        "KVOffloadPolicy",
    )
    assert spec["names"]["shortNames"] == ["kvop"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = {c["name"] for c in version["additionalPrinterColumns"]}
    assert {"Pool", "Mode", "Matched", "Injected", "Ready", "Capacity", "Used", "Age"} <= columns
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert {
        "conditions",
        "observedGeneration",
        "matchedPods",
        "injectedPods",
        "readySidecars",
        "poolCapacityBytes",
        "poolUsedBytes",
        "poolCapacity",
        "poolUsed",
        "nodePool",
    } <= set(status)
    assert status["conditions"]["x-kubernetes-list-map-keys"] == ["type"]
    # every status column names a status field of the schema, of the column's type
    for column in version["additionalPrinterColumns"]:
        path = column["jsonPath"]
        if path.startswith(".status.") and "[" not in path:
            first, *rest = path.removeprefix(".status.").split(".")
            field = status[first]
            for name in rest:  # a nested field (.status.nodePool.sharedCapacity)
                field = field["properties"][name]
            assert field["type"] == column["type"], column


@pytest.mark.parametrize("k8s", ["1.29.0", "1.33.0"])
def test_crd_is_a_valid_kubernetes_object(k8s: str) -> None:
    kubernetes_validate.validate(load_crd(), k8s, strict=True)


def test_chart_copy_is_in_sync() -> None:
    """`make crds-sync` output; CI's crds-check fails on a stale copy too."""
    chart_copy = ROOT / "charts" / "kvoffload" / "crds" / "kvoffloadpolicy.yaml"
    assert chart_copy.read_bytes() == CRD_PATH.read_bytes()


def test_cel_rules_see_defaults() -> None:
    """hugepages defaults to false, so an odd size passes; set it and the rule fires."""
    raw = yaml.safe_load((ROOT / "crds/examples/minimal.yaml").read_text())
    raw["spec"]["pool"]["size"] = "3Mi"
    assert validate(raw)[1] == []
    bad = copy.deepcopy(raw)
    bad["spec"]["pool"]["hugepages"] = True
    assert validate(bad)[1] != []


@pytest.mark.parametrize("field", ["mode", "loadMode"])
def test_every_mode_the_connector_takes_is_accepted_at_apply_and_injected(field: str) -> None:
    """The CRD, policy.py and the injected --kv-transfer-config agree with the connector: a
    value the connector supports is never refused by the API server or dropped by the webhook."""
    from kvoffload_connector.common.config import LoadMode as ConnectorLoadMode
    from kvoffload_connector.common.config import StoreMode
    from kvoffload_operator.inject.render import kv_transfer_config

    values = [m.value for m in (StoreMode if field == "mode" else ConnectorLoadMode)]
    key = "mode" if field == "mode" else "load_mode"
    raw = yaml.safe_load((ROOT / "crds/examples/minimal.yaml").read_text())
    for value in values:
        obj = copy.deepcopy(raw)
        obj["spec"].setdefault("offload", {})[field] = value
        _, errors = validate(obj)
        assert errors == [], (value, errors)
        policy = policy_from_resource(obj)
        assert kv_transfer_config(policy)["kv_connector_extra_config"][key] == value
