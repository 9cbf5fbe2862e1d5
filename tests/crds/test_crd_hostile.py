"""Hostile policy values the CRD refuses at apply (bounds, grammars, cross-field CEL rules),
and every policy the repository ships or tests with still accepted."""

from __future__ import annotations

import ast
import copy
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvoffload_operator.annotations import SKIP_REASON
from kvoffload_operator.policy import PolicyError, policy_from_resource
from kvoffload_operator.status import MAX_SKIP_REASONS, skipped_counts

from tests.crds.crdschema import ROOT, openapi_schema, validate

MINIMAL = yaml.safe_load((ROOT / "crds/examples/minimal.yaml").read_text())
BAD_DIR = Path(__file__).parent / "bad"


def _policies_in_yaml(text: str) -> list[dict[str, Any]]:
    return [
        d
        for d in yaml.safe_load_all(text)
        if isinstance(d, dict) and d.get("kind") == "KVOffloadPolicy"
    ]


def _python_accepts(obj: dict[str, Any]) -> bool:
    """A test's dict is a good policy where policy.py takes it (some are built to be refused)."""
    try:
        policy_from_resource(obj)
    except PolicyError:
        return False
    return True


def _fixture_policies() -> Iterator[tuple[str, dict[str, Any]]]:
    """Every KVOffloadPolicy the repository holds outside tests/crds: YAML files, YAML
    blocks and heredocs of Markdown, YAML strings and literal dicts of Python files."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.yaml", "*.md", "*.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for rel in map(Path, sorted(listed)):
        path = ROOT / rel
        if not path.is_file() or rel.parts[:2] == ("tests", "crds"):
            continue  # tests/crds: the bad examples and these tests
        if rel.parts[0] in ("crds", "charts") and rel.parts[-2] == "crds":
            continue  # the CRD itself
        text = path.read_text(errors="replace")
        if "KVOffloadPolicy" not in text:
            continue
        if path.suffix == ".yaml" and "{{" not in text:
            for i, doc in enumerate(_policies_in_yaml(text)):
                yield f"{rel}#{i}", doc
        elif path.suffix == ".md":  # a YAML block, or a heredoc of a shell block
            blocks = re.findall(r"```\w*\n(.*?)```", text, re.S)
            for i, block in enumerate(b for b in blocks if "kind: KVOffloadPolicy" in b):
                body = block.split("<<'EOF'\n")[-1].split("\nEOF\n")[0]
                for j, doc in enumerate(_policies_in_yaml(body)):
                    yield f"{rel}#{i}.{j}", doc
        elif path.suffix == ".py":
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    if "kind: KVOffloadPolicy" in node.value:
                        for j, doc in enumerate(_policies_in_yaml(node.value)):
                            yield f"{rel}:{node.lineno}.{j}", doc
                elif isinstance(node, ast.Dict):
                    try:
                        value = ast.literal_eval(node)
                    except ValueError:
                        continue  # built from variables: exercised by its own test
                    if value.get("kind") == "KVOffloadPolicy" and _python_accepts(value):
                        yield f"{rel}:{node.lineno}", value


FIXTURES = list(_fixture_policies())


def test_the_fixture_scan_finds_the_repositorys_policies() -> None:
    names = {n.split("#")[0].split(":")[0] for n, _ in FIXTURES}
    assert {"crds/examples/full.yaml", "tests/pod/policy.yaml", "README.md"} <= names
    assert "tests/chart/test_chart_cluster.py" in names
    assert len(FIXTURES) >= 20, [n for n, _ in FIXTURES]


@pytest.mark.parametrize(("name", "policy"), FIXTURES, ids=[n for n, _ in FIXTURES])
def test_every_fixture_policy_is_accepted(name: str, policy: dict[str, Any]) -> None:
    obj = copy.deepcopy(policy)
    obj.setdefault("apiVersion", "kvoffload.io/v1alpha1")
    obj.setdefault("metadata", {"name": "fixture"})
    assert validate(obj)[1] == []


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation of the minimal policy: ``path`` (dot-separated keys) := value."""

    def apply(obj: dict[str, Any]) -> None:
        node: Any = obj
        parts = path.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value

    return apply


LONG_PREFIX = "a" * 250 + ".example"  # a DNS-subdomain-shaped prefix of 258 characters


def _node_pool(**fields: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation to placement node (tenant team-a of gpu-nodes, no size), with ``fields``."""
    return _set("spec.pool", {"placement": "node", "nodePool": "gpu-nodes", "tenant": "team-a",
                              **fields})  # fmt: skip


SHA = "sha256:" + "0" * 64
SALTS = {"tenants": [{"name": "a", "cacheSalts": ["a"]}]}
# (id, mutation, what the refusal says); each is accepted by a CRD without the bound
HOSTILE: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    # selector
    ("label-value-newline", _set("spec.selector.matchLabels.app", "vllm\nx"), "does not match"),
    ("label-value-shell", _set("spec.selector.matchLabels.app", "$(reboot)"), "does not match"),
    ("label-key-shell", _set("spec.selector.matchLabels", {"app;rm -rf": "x"}), "label key"),
    ("label-key-newline", _set("spec.selector.matchLabels", {"app\n": "x"}), "label key"),
    ("label-key-name-64", _set("spec.selector.matchLabels", {"a" * 64: "x"}), "label key"),
    (
        "label-key-prefix-258",
        _set("spec.selector.matchLabels", {f"{LONG_PREFIX}/app": "x"}),
        "prefix of at most 253",
    ),
    (
        "expression-key-shell",
        _set("spec.selector.matchExpressions", [{"key": "a|b", "operator": "Exists"}]),
        "does not match",
    ),
    (
        "expression-key-empty",
        _set("spec.selector.matchExpressions", [{"key": "", "operator": "Exists"}]),
        "non-empty",
    ),
    (
        "expression-key-prefix-258",
        _set("spec.selector.matchExpressions", [{"key": f"{LONG_PREFIX}/a", "operator": "Exists"}]),
        "prefix (before '/') must be at most 253",
    ),
    (
        "expression-value-newline",
        _set(
            "spec.selector.matchExpressions",
            [{"key": "tier", "operator": "In", "values": ["prod\nx"]}],
        ),
        "does not match",
    ),
    # the vLLM container and the images
    ("container-name-shell", _set("spec.vllmContainer.name", "vllm;id"), "does not match"),
    ("container-name-upper", _set("spec.vllmContainer.name", "Engine"), "does not match"),
    ("sidecar-image-shell", _set("spec.sidecar.image", "x;curl evil|sh"), "does not match"),
    ("sidecar-image-newline", _set("spec.sidecar.image", "ghcr.io/a/b:1\n"), "does not match"),
    ("sidecar-image-space", _set("spec.sidecar.image", "ghcr.io/a/b:1 --x"), "does not match"),
    ("connector-image-subshell", _set("spec.connector.image", "$(id)"), "does not match"),
    (
        "connector-image-bad-digest",
        _set("spec.connector.image", "a/b@sha256:xyz"),
        "does not match",
    ),
    # sidecar resources
    (
        "resources-too-many",
        _set("spec.sidecar.resources.requests", {f"example.com/r{i}": "1" for i in range(17)}),
        "too many properties",
    ),
    ("resource-value-shell", _set("spec.sidecar.resources.requests.cpu", "1;rm"), "does not match"),
    (
        "resource-value-33-chars",
        _set("spec.sidecar.resources.limits.cpu", "1" * 33),
        "is too long",
    ),
    ("resource-int-huge", _set("spec.sidecar.resources.limits.cpu", 10**16), "maximum"),
    ("resource-int-negative", _set("spec.sidecar.resources.requests.cpu", -1), "minimum"),
    (
        "resource-name-shell",
        _set("spec.sidecar.resources.requests", {"cpu;id": "1"}),
        "every key must be a resource name",
    ),
    (
        "limit-name-newline",
        _set("spec.sidecar.resources.limits", {"cpu\n": "1"}),
        "limits: every key must be a resource name",
    ),
    (
        "request-above-limit",
        _set("spec.sidecar.resources", {"requests": {"cpu": "2"}, "limits": {"cpu": "1500m"}}),
        "a request must not be above the limit",
    ),
    (
        "request-above-limit-int-and-string",
        _set("spec.sidecar.resources", {"requests": {"memory": "2Gi"}, "limits": {"memory": 1024}}),
        "a request must not be above the limit",
    ),
    # connector extra config
    (
        "extra-config-key-shell",
        _set("spec.connector.extraConfig", {"a;b": "1"}),
        "every key must be a connector setting name",
    ),
    (
        "extra-config-key-64",
        _set("spec.connector.extraConfig", {"k" * 64: "1"}),
        "every key must be a connector setting name",
    ),
    ("extra-config-value-newline", _set("spec.connector.extraConfig.x", "1\n2"), "does not match"),
    ("extra-config-value-nul", _set("spec.connector.extraConfig.x", "1\x00"), "does not match"),
    # tenants
    (
        "cache-salt-newline",
        _set("spec.tenants", [{"name": "a", "cacheSalts": ["team\na"]}]),
        "does not match",
    ),
    # placement node: the names of the node pool (DNS-1123 subdomain) and its tenant (label)
    ("node-pool-upper", _node_pool(nodePool="GPU-Nodes"), "does not match"),
    ("node-pool-shell", _node_pool(nodePool="gpu;rm -rf /"), "does not match"),
    ("node-pool-newline", _node_pool(nodePool="gpu-nodes\n"), "does not match"),
    ("node-pool-slash", _node_pool(nodePool="gpu/nodes"), "does not match"),
    ("node-pool-trailing-dot", _node_pool(nodePool="gpu-nodes."), "does not match"),
    ("node-pool-254", _node_pool(nodePool="a" * 254), "is too long"),
    ("tenant-dot", _node_pool(tenant="team.a"), "does not match"),
    ("tenant-underscore", _node_pool(tenant="team_a"), "does not match"),
    ("tenant-leading-dash", _node_pool(tenant="-team"), "does not match"),
    ("tenant-newline", _node_pool(tenant="team-a\n"), "does not match"),
    ("tenant-empty", _node_pool(tenant=""), "does not match"),
    ("tenant-64", _node_pool(tenant="a" * 64), "is too long"),
    # status (written by the operator; bounded all the same)
    ("status-count-negative", _set("status.matchedPods", -1), "minimum"),
    ("status-count-huge", _set("status.injectedPods", 10**7), "maximum"),
    ("status-generation-negative", _set("status.observedGeneration", -1), "minimum"),
    (
        "status-skipped-too-many",
        _set("status.skipped", {f"r{i}": 1 for i in range(33)}),
        "too many properties",
    ),
    ("status-hash-not-hex", _set("status.policyHash", "abc;rm"), "does not match"),
    ("status-hash-65", _set("status.policyHash", "a" * 65), "is too long"),
    ("status-capacity-words", _set("status.poolCapacity", "lots"), "does not match"),
    (
        "status-condition-reason-spaces",
        _set(
            "status.conditions",
            [
                {
                    "type": "Ready",
                    "status": "True",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                    "reason": "Not a reason\n",
                    "message": "m",
                }
            ],
        ),
        "does not match",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "expected"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE]
)
def test_hostile_value_is_refused(mutate: Callable[[dict[str, Any]], None], expected: str) -> None:
    obj = copy.deepcopy(MINIMAL)
    mutate(obj)
    errors = validate(obj)[1]
    assert any(expected in e for e in errors), errors


# (id, mutation) of values at the edge of a bound: accepted
EDGE: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
    ("labels", _set("spec.selector.matchLabels", {"app.kubernetes.io/name": "a-b.c_d", "x": ""})),
    (
        "image-digest",
        _set("spec.sidecar.image", f"registry.local:5000/team/kvoffload-sidecar:v1.2_3@{SHA}"),
    ),
    ("image-empty", _set("spec.sidecar.image", "")),
    ("image-ipv6", _set("spec.connector.image", "[::1]:5000/connector")),
    (
        "resources",
        _set(
            "spec.sidecar.resources",
            {
                "requests": {"cpu": "250m", "memory": "1Gi", "hugepages-2Mi": "2Mi"},
                "limits": {"cpu": 1, "memory": "1Gi", "example.com/device": "1e2"},
            },
        ),
    ),
    ("extra", _set("spec.connector.extraConfig", {"lookup_timeout_ms": "150", "Flag_2": "a b=c"})),
    ("name", _set("spec.vllmContainer.name", "vllm-0")),
    (
        "node-names",
        _node_pool(nodePool=".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61]), tenant="t" * 63),
    ),
    ("node-with-size", _node_pool(size="64Gi", eviction="lru", hugepages=False)),
    ("node-minimal", _node_pool()),
    ("status", _set("status.skipped", {"has-kv-transfer-config": 2})),
]


@pytest.mark.parametrize("mutate", [e[1] for e in EDGE], ids=[e[0] for e in EDGE])
def test_values_at_the_edge_of_a_bound_are_accepted(
    mutate: Callable[[dict[str, Any]], None],
) -> None:
    obj = copy.deepcopy(MINIMAL)
    mutate(obj)
    assert validate(obj)[1] == []


def test_a_set_list_refuses_a_repeated_item() -> None:
    obj = copy.deepcopy(MINIMAL)
    obj["spec"]["tenants"] = [{"name": "a", "cacheSalts": ["s", "s"]}]
    assert any("Duplicate value" in e for e in validate(obj)[1])


def _nodes(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from _nodes(sub, f"{path}.{key}")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _nodes(schema["additionalProperties"], f"{path}.*")
    if isinstance(schema.get("items"), dict):
        yield from _nodes(schema["items"], f"{path}[]")


# validated by the API server itself (apiVersion, kind) or free text bounded by maxLength
UNPATTERNED = {".apiVersion", ".kind", ".status.conditions[].message"}


def test_every_field_is_bounded() -> None:
    """What keeps a policy small and the API server's CEL cost estimates finite: every string
    has a maxLength and a grammar (or is an enum), every list a maxItems, every map a
    maxProperties, every number a minimum and a maximum."""
    unbounded = []
    for path, node in _nodes(openapi_schema()):
        if path in (".apiVersion", ".kind"):
            continue
        kind = "int-or-string" if node.get("x-kubernetes-int-or-string") else node.get("type")
        need: tuple[str, ...] = ()
        if kind == "string" and "enum" not in node:
            need = ("maxLength",) + (
                () if path in UNPATTERNED or "format" in node else ("pattern",)
            )
        elif kind in ("integer", "number"):
            need = ("minimum", "maximum")
        elif kind == "int-or-string":
            need = ("minimum", "maximum", "maxLength", "pattern")
        elif kind == "array":
            need = ("maxItems",)
        elif kind == "object" and "additionalProperties" in node:
            need = ("maxProperties",)
        unbounded += [f"{path}: {k}" for k in need if k not in node]
    assert unbounded == []


def _rules(schema: dict[str, Any]) -> list[str]:
    return [
        r["message"] for _, n in _nodes(schema) for r in n.get("x-kubernetes-validations") or []
    ]


def test_every_cel_rule_refuses_a_case_with_its_message() -> None:
    """Each rule's message is what some hostile case or tests/crds/bad example is refused with."""
    expected = [h[2] for h in HOSTILE] + [
        line.split(": ", 1)[1]
        for p in BAD_DIR.glob("*.yaml")
        for line in p.read_text().splitlines()
        if line.startswith("# expect: ")
    ]
    untested = [m for m in _rules(openapi_schema()) if not any(e in m for e in expected)]
    assert untested == []


def test_cel_rules_hold_no_escapes() -> None:
    """A backslash in a rule is a CEL string escape ('\\.' is none, and the API server refuses
    the CRD) that cel-python lets through: regexes in rules say [.] instead."""
    rules = [
        r["rule"]
        for _, n in _nodes(openapi_schema())
        for r in n.get("x-kubernetes-validations") or []
    ]
    assert [r for r in rules if "\\" in r] == []


def test_the_status_the_operator_writes_for_any_skip_reasons_fits_the_crd() -> None:
    """Pod authors can write any kvoffload.io/skip-reason: the counts keep the most frequent
    within status.skipped's bound, so the status patch is never refused."""
    pods = [{"metadata": {"annotations": {SKIP_REASON: f"reason-{i % 40}"}}} for i in range(40 + 5)]
    skipped = skipped_counts(pods)
    assert len(skipped) == MAX_SKIP_REASONS
    assert all(skipped[f"reason-{i}"] == 2 for i in range(5))  # the most frequent are kept
    obj = copy.deepcopy(MINIMAL) | {"status": {"skipped": skipped}}
    assert validate(obj)[1] == []
