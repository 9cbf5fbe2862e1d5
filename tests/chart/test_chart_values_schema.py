"""values.schema.json: wrong types and unknown keys fail `helm lint` and `helm template` with the
field named; every value is typed, described in the schema and commented in values.yaml."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvoffload"
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())

# (helm flags, the JSON pointer helm must name in its error)
BAD_VALUES = [
    (["--set-string", "operator.replicas=two"], "/operator/replicas"),
    (["--set", "operator.replicas=0"], "/operator/replicas"),
    (["--set", "webhook.failurePolicy=Maybe"], "/webhook/failurePolicy"),
    (["--set", "webhook.reinvocationPolicy=Sometimes"], "/webhook/reinvocationPolicy"),
    (["--set", "webhook.timeoutSeconds=60"], "/webhook/timeoutSeconds"),
    (["--set-string", "webhook.certManager.enabled=yes"], "/webhook/certManager/enabled"),
    (["--set", "webhook.certManager.issuerRef.kind=Vault"], "/webhook/certManager/issuerRef"),
    (["--set-string", "monitoring.dashboard.enabled=true"], "/monitoring/dashboard/enabled"),
    (["--set", "image.pullPolicy=Sometimes"], "/image/pullPolicy"),
    (["--set", "image.digest=latest"], "/image/digest"),
    (["--set", "operator.logLevel=verbose"], "/operator/logLevel"),
    (["--set", "operator.watchNamespace=Not_A_Namespace"], "/operator/watchNamespace"),
    (["--set", "operator.metricsPort=70000"], "/operator/metricsPort"),
    (["--set", "nodeAgent.metrics.port=70000"], "/nodeAgent/metrics/port"),
    (["--set", "operator.replica=2"], "/operator"),  # a typo: unknown keys are refused
    (
        [
            "--set",
            "webhook.namespaceSelector.matchExpressions[0].key=x",
            "--set",
            "webhook.namespaceSelector.matchExpressions[0].operator=Equals",
        ],
        "/webhook/namespaceSelector/matchExpressions/0/operator",
    ),
    (["--set", "policies[0].spec.pool.size=1Gi"], "/policies/0"),  # no name
]


@pytest.mark.process
@pytest.mark.parametrize("command", ["lint", "template"])
@pytest.mark.parametrize(("flags", "field"), BAD_VALUES, ids=[f for _, f in BAD_VALUES])
def test_wrong_values_fail_and_name_the_field(helm, command, flags, field):
    args = ["lint", "--strict", str(CHART)] if command == "lint" else ["template", "kv", str(CHART)]
    result = helm(*args, *flags)
    output = result.stdout + result.stderr
    assert result.returncode != 0, f"helm {command} accepted {flags}"
    assert f"at '{field}'" in output, output


def test_schema_refuses_unknown_keys_at_every_documented_level():
    """Each object with declared properties is closed (a typo must not be silently ignored)."""
    open_objects = [
        path
        for path, node in _schema_nodes(SCHEMA, "")
        if node.get("type") == "object"
        and "properties" in node
        and node.get("additionalProperties") is not False
    ]
    assert not open_objects


def test_every_schema_property_has_a_type_and_a_description():
    """List items need a type; named properties also need a description."""
    untyped = [path for path, node in _schema_nodes(SCHEMA, "") if path and "type" not in node]
    undescribed = [
        path
        for path, node in _schema_nodes(SCHEMA, "")
        if path and not path.endswith("/items") and not node.get("description")
    ]
    assert (untyped, undescribed) == ([], [])


def test_values_yaml_is_valid_against_the_schema():
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(VALUES, SCHEMA)


def test_every_value_is_declared_in_the_schema():
    """Walk values.yaml; each key must exist in the schema down to free-form objects."""
    undeclared = [path for path in _value_paths(VALUES, SCHEMA, "") if path is not None]
    assert not undeclared


def test_every_value_in_values_yaml_has_a_comment():
    """vault-helm habit: the line above each typed (leaf) key is a comment that documents it."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    uncommented = []
    for path, lineno in _key_lines(lines):
        node = _schema_at(SCHEMA, path)
        if node is None or "properties" in node:
            continue  # a section header or inside a free-form object (documented by its parent)
        previous = next((ln.strip() for ln in reversed(lines[:lineno]) if ln.strip()), "")
        if not previous.startswith("#"):
            uncommented.append(".".join(path))
    assert not uncommented


# --- helpers ------------------------------------------------------------------------------------


def _schema_nodes(node: dict[str, Any], path: str):
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from _schema_nodes(child, f"{path}/{name}")
    items = node.get("items")
    if isinstance(items, dict):
        yield from _schema_nodes(items, f"{path}/items")


def _value_paths(value: Any, node: dict[str, Any] | None, path: str):
    """Yield the paths of values the schema does not declare."""
    if node is None:
        yield path
        return
    if isinstance(value, dict) and "properties" in node:
        for key, child in value.items():
            yield from _value_paths(child, node["properties"].get(key), f"{path}/{key}")


def _schema_at(schema: dict[str, Any], path: list[str]) -> dict[str, Any] | None:
    node: dict[str, Any] | None = schema
    for key in path:
        if node is None or "properties" not in node:
            return None
        node = node["properties"].get(key)
    return node


KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.\-/\"]+):(\s|$)")


def _key_lines(lines: list[str]):
    """(key path, line index) for each mapping key outside comments and list items."""
    stack: list[tuple[int, str]] = []
    for index, line in enumerate(lines):
        if not line.strip() or line.lstrip().startswith("#") or line.lstrip().startswith("-"):
            continue
        match = KEY.match(line)
        if not match:
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, match["key"].strip('"')))
        yield [k for _, k in stack], index
