"""policy.py (what the offline ``kvoffload inject --policy FILE`` parses with) refuses every
hostile spec value the CRD refuses, in the CRD's words, and accepts every policy the CRD accepts;
its table of the schema's bounds is the CRD's, field by field."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import re2
import yaml
from kvoffload_operator.cli import main_inject
from kvoffload_operator.policy import PolicyError, policy_from_resource
from kvoffload_operator.policy_limits import BOUNDS, PREFIX_AT_MOST_253, QUALIFIED_NAME, Bound

from tests.crds.crdschema import openapi_schema, validate
from tests.crds.test_crd_hostile import EDGE, FIXTURES, HOSTILE, MINIMAL

# the words of a schema refusal (the hostile table's) -> the CRD keyword whose limit it names
_KEYWORD = {
    "does not match": "pattern",
    "is too long": "maxLength",
    "non-empty": "minLength",
    "too many properties": "maxProperties",
    "maximum": "maximum",
    "minimum": "minimum",
}


def _mutated(mutate: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    obj = copy.deepcopy(MINIMAL)
    mutate(obj)
    return obj


def _spec_cases() -> Iterator[tuple[str, dict[str, Any], str, str]]:
    """(id, object, the CRD's refusal, the table's words) of each case refused under spec."""
    for name, mutate, words in HOSTILE:
        obj = _mutated(mutate)
        refusal = next(e for e in validate(obj)[1] if words in e)
        if refusal.startswith("spec."):  # status cases: the operator writes status, not users
            yield name, obj, refusal, words


SPEC_CASES = list(_spec_cases())


def _node(path: str) -> dict[str, Any]:
    """The schema node at a refusal's path (``spec.a.0.b``: list items by index)."""
    node = openapi_schema()
    for part in path.split("."):
        if part.isdigit():
            node = node["items"]
        else:
            node = (node.get("properties") or {}).get(part) or node["additionalProperties"]
    return node


def test_every_spec_case_of_the_hostile_table_is_here() -> None:
    statuses = [h[0] for h in HOSTILE if h[0].startswith("status-")]
    assert len(SPEC_CASES) == len(HOSTILE) - len(statuses) >= 30


@pytest.mark.parametrize(
    ("obj", "refusal", "words"), [c[1:] for c in SPEC_CASES], ids=[c[0] for c in SPEC_CASES]
)
def test_policy_py_refuses_what_the_crd_refuses_in_its_words(
    obj: dict[str, Any], refusal: str, words: str
) -> None:
    with pytest.raises(PolicyError) as exc:
        policy_from_resource(obj)
    message = str(exc.value)
    assert words in message
    where, _, what = refusal.partition(": ")
    if what.startswith("Invalid value: "):  # a CEL rule: its message, word for word
        assert what.removeprefix("Invalid value: ") in message
    else:  # a schema bound: the field and the limit
        field = message.split(": ", 1)[0].replace("[", ".").replace("]", "")
        assert field == where
        assert str(_node(where)[_KEYWORD[words]]) in message


BAD = {
    p.name: yaml.safe_load(p.read_text())
    for p in sorted((Path(__file__).parent / "bad").glob("*.yaml"))
}


def _cel_refusals(obj: dict[str, Any]) -> list[str]:
    return [
        e.split(": Invalid value: ", 1)[1] for e in validate(obj)[1] if ": Invalid value: " in e
    ]


def _python_refusal(obj: dict[str, Any]) -> str:
    with pytest.raises(PolicyError) as exc:
        policy_from_resource(obj)
    return str(exc.value)


CEL_BAD = {name: obj for name, obj in BAD.items() if _cel_refusals(obj)}


@pytest.mark.parametrize("obj", list(CEL_BAD.values()), ids=list(CEL_BAD))
def test_a_bad_example_a_cel_rule_refuses_is_refused_in_its_words(obj: dict[str, Any]) -> None:
    message = _python_refusal(obj)
    assert any(m in message for m in _cel_refusals(obj)), message


def test_every_cel_rule_on_the_spec_has_its_words_in_policy_py() -> None:
    """Keeps the promise when a rule is added: its message must be what policy.py says for some
    hostile case or bad example (add one of those with the rule)."""
    spec = openapi_schema()["properties"]["spec"]
    rules = [
        r["message"] for _, n in _crd_nodes(spec) for r in n.get("x-kubernetes-validations") or []
    ]
    said = [_python_refusal(obj) for _, obj, _, _ in SPEC_CASES] + [
        _python_refusal(obj) for obj in BAD.values()
    ]
    assert len(rules) >= 20
    assert [m for m in rules if not any(m in s for s in said)] == []


def _crd_nodes(node: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    yield "", node
    for sub in (node.get("properties") or {}).values():
        yield from _crd_nodes(sub)
    for key in ("additionalProperties", "items"):
        if isinstance(node.get(key), dict):
            yield from _crd_nodes(node[key])


GOOD = [(f"fixture:{n}", p) for n, p in FIXTURES] + [(f"edge:{n}", _mutated(m)) for n, m in EDGE]


@pytest.mark.parametrize("policy", [g[1] for g in GOOD], ids=[g[0] for g in GOOD])
def test_policy_py_accepts_what_the_crd_accepts(policy: dict[str, Any]) -> None:
    obj = copy.deepcopy(policy)
    obj.setdefault("metadata", {"name": "fixture"})
    assert validate(obj)[1] == []
    pool = policy_from_resource(obj).pool
    assert pool.size_bytes > 0 or (pool.node and pool.node_pool and pool.tenant)


# Bound's fields -> the CRD's keywords
_KEYWORDS = {
    "min_length": "minLength",
    "max_length": "maxLength",
    "pattern": "pattern",
    "max_items": "maxItems",
    "max_properties": "maxProperties",
    "minimum": "minimum",
    "maximum": "maximum",
}


def _crd_bounds(node: dict[str, Any], path: str = "spec") -> Iterator[tuple[str, dict[str, Any]]]:
    limits = {ours: node[theirs] for ours, theirs in _KEYWORDS.items() if theirs in node}
    if limits:
        yield path, limits
    for key, sub in (node.get("properties") or {}).items():
        yield from _crd_bounds(sub, f"{path}.{key}")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _crd_bounds(node["additionalProperties"], f"{path}.*")
    if isinstance(node.get("items"), dict):
        yield from _crd_bounds(node["items"], f"{path}[]")


def test_the_bounds_table_is_the_crds() -> None:
    """One source of truth: a bound added to or changed in the CRD fails here until policy_limits
    says the same."""
    crd = dict(_crd_bounds(openapi_schema()["properties"]["spec"]))
    ours = {
        path: {k: getattr(b, k) for k in _KEYWORDS if getattr(b, k) is not None}
        for path, b in BOUNDS.items()
    }
    assert ours == crd


PROBES = [
    "", "a", "A", "a\n", "\n", "a\nb", "-a", "a-", "a.b", "a_b", "a/b", "a b", "a;b", "$(id)",
    "\x00", "\x7f", "é", "64Gi", "64Gi\n", "1.5", "250m", "1e2", "1e999", "25%", "100%", "100.5%",
    "ghcr.io/a/b:1", "ghcr.io/a/b:1\n", "[::1]:5000/c", "a/b@sha256:" + "0" * 64, "x" * 300,
    "example.com/device", "a" * 254 + "/b", "A/b",
]  # fmt: skip


@pytest.mark.parametrize(
    "pattern",
    sorted(
        {b.pattern for b in BOUNDS.values() if b.pattern} | {QUALIFIED_NAME, PREFIX_AT_MOST_253}
    ),
)
def test_pythons_whole_match_is_the_api_servers_regexp(pattern: str) -> None:
    """fullmatch with Python's re agrees with RE2's search (the API server's Go regexp)."""
    ours = Bound(pattern=pattern)
    differ = [
        p for p in PROBES if (ours._regex.fullmatch(p) is None) == bool(re2.search(pattern, p))
    ]
    assert differ == []


POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "engine", "labels": {"app": "vllm"}},
    "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai", "args": ["m"]}]},
}


def test_kvoffload_inject_refuses_each_hostile_policy_file(tmp_path: Path, capsys) -> None:
    """The command users run offline: exit 2 and the refusal on stderr, nothing written."""
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(yaml.safe_dump(POD))
    out = tmp_path / "out.yaml"
    wrong = []
    for name, obj, _, words in SPEC_CASES:
        policy = tmp_path / f"{name}.yaml"
        policy.write_text(yaml.safe_dump(obj))
        rc = main_inject(["-f", str(manifest), "--policy", str(policy), "-o", str(out)])
        err = capsys.readouterr().err
        if rc != 2 or out.exists() or "invalid policy: spec." not in err or words not in err:
            wrong.append((name, rc, err))
    assert wrong == []
    policy.write_text(yaml.safe_dump(MINIMAL))  # the control: the same command injects
    assert main_inject(["-f", str(manifest), "--policy", str(policy), "-o", str(out)]) == 0
    assert "kvoffload-sidecar" in out.read_text()
