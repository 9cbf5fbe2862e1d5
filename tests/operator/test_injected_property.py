"""Every pod the injector writes, over every fixture there is, satisfies its property
(`kvoffload_operator.inject.verify`), or the injector left the pod alone.

Fixtures are globbed, not listed: the golden cases (``testdata/*.yaml``), the public pod shapes
(``tests/pod/manifests/*.yaml``) and every container shape in `test_engine_shapes` (its
module-level lists). For an injected pod:
1. the pure checks the webhook runs (structure; the flag's delivery re-parsed as the shell does);
2. strict OpenAPI validation against the oldest Kubernetes the chart supports (its
   ``kubeVersion``) and the newest kubernetes-validate knows, wherever the input itself
   validates (a pod-level ``resources`` needs 1.34: the injector cannot be blamed for that);
3. the command line run in dash or bash against a stand-in vLLM (`verify_exec`): the engine
   gets ``--kv-transfer-config`` once, as the policy's JSON. A fixture whose run cannot be
   verified says so in a ``# verify: unverifiable <words of the reason>`` line, and the test
   checks that it still is (so the line cannot go stale).

Each leg is shown to fail: renderings broken on purpose (a mount path twice, a field the API
server refuses, JSON quoted once inside an ``eval``, the flag twice) are caught by the leg
meant to catch them, and a script that drops its arguments by the execution alone.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version, schema_contents
from kvoffload_operator import inject as inject_pkg
from kvoffload_operator.inject import Injection, inject_pod
from kvoffload_operator.inject.render import kv_transfer_config
from kvoffload_operator.inject.shell import Parse
from kvoffload_operator.inject.verify import intent_of, verify
from kvoffload_operator.inject.verify_exec import UNVERIFIED, configmaps_of, run_delivery
from kvoffload_operator.policy import Policy, policies_from_documents
from kvoffload_operator.workloads import group_size, pod_templates
from referencing import Registry, Resource

from tests.operator import test_engine_shapes as shapes
from tests.operator.golden import DEFAULTS, cases

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]
POD_MANIFESTS = ROOT / "tests" / "pod" / "manifests"
POD_POLICY = ROOT / "tests" / "pod" / "policy.yaml"
CHART = ROOT / "charts" / "kvoffload" / "Chart.yaml"


def chart_versions() -> tuple[str, str]:
    """(oldest, newest) Kubernetes to validate against: the chart's kubeVersion floor, and the
    newest schema kubernetes-validate ships (the chart sets no ceiling)."""
    floor = re.search(r">=\s*v?(\d+\.\d+)", yaml.safe_load(CHART.read_text())["kubeVersion"])
    assert floor, "charts/kvoffload/Chart.yaml: kubeVersion has no >= floor"
    return f"{floor.group(1)}.0", latest_version()


@dataclass(frozen=True)
class Fixture:
    id: str
    template: Mapping[str, Any]
    policies: list[Policy]
    group_size: int | None = None
    configmaps: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    unverifiable: str | None = None  # the `# verify: unverifiable ...` words


def _unverifiable(text: str) -> str | None:
    m = re.search(r"^# verify: unverifiable (.+)$", text, re.M)
    return m.group(1).strip() if m else None


def _from_file(prefix: str, path: Path, policies: list[Policy]) -> Iterator[Fixture]:
    text = path.read_text()
    docs = [d for d in yaml.safe_load_all(text) if isinstance(d, Mapping)]
    configmaps = configmaps_of(docs)
    for i, doc in enumerate(docs):
        for tpath, template in pod_templates(doc):
            where = ".".join(tpath) or "pod"
            yield Fixture(
                f"{prefix}/{path.stem}/{i}-{doc.get('kind')}-{where}",
                template,
                policies,
                group_size(doc),
                configmaps,
                _unverifiable(text),
            )


def _shape_containers() -> Iterator[tuple[str, dict[str, Any]]]:
    """Every container shape in test_engine_shapes' module-level lists."""
    for name, value in sorted(vars(shapes).items()):
        if not (name.isupper() and isinstance(value, list)):
            continue
        for n, item in enumerate(value):
            values = getattr(item, "values", item)  # pytest.param(...) or a plain tuple
            first = values[0] if isinstance(values, tuple | list) and values else values
            if isinstance(first, dict):
                yield f"{name}[{n}]", first
            elif isinstance(first, str) and isinstance(values, tuple):  # a shell script
                yield f"{name}[{n}]-command", {"command": ["/bin/bash", "-ec", first]}
                yield f"{name}[{n}]-args", {"command": ["/bin/bash"], "args": ["-c", first]}


def fixtures() -> list[Fixture]:
    out = []
    for case in cases():
        out += _from_file("testdata", case.input, case.policies())
    pod_policies = policies_from_documents(list(yaml.safe_load_all(POD_POLICY.read_text())))
    for path in sorted(POD_MANIFESTS.glob("*.yaml")):
        out += _from_file("pod", path, pod_policies)
    for name, container in _shape_containers():
        pod = {
            "metadata": {"name": "x"},
            "spec": {"containers": [{"name": "c", "image": "example.com/app:1", **container}]},
        }
        out.append(Fixture(f"shapes/{name}", pod, [shapes.POLICY]))
    return out


FIXTURES = fixtures()
OLDEST, NEWEST = chart_versions()


def as_pod(template: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": dict(template.get("metadata") or {}),
        "spec": template.get("spec"),
    }


@functools.cache
def _pod_validator(version: str) -> jsonschema.Validator:
    """kubernetes-validate's strict Pod schema for ``version``, built once (its `validate`
    rereads the definitions file on every call: seconds over all fixtures)."""
    folder = f"kubernetes-json-schema/v{version}-local-strict"
    schema = schema_contents(f"{folder}/pod-v1.json", version)
    definitions = schema_contents(f"{folder}/_definitions.json", version)
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def _validates(obj: Mapping[str, Any], version: str) -> str | None:
    error = jsonschema.exceptions.best_match(_pod_validator(version).iter_errors(dict(obj)))
    return None if error is None else f"{'.'.join(map(str, error.absolute_path))}: {error.message}"


def test_the_fast_schema_check_is_kubernetes_validates() -> None:
    """The cached validator says what kubernetes-validate says, on a good and a bad pod."""
    good = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"},
            "spec": {"containers": [{"name": "c", "image": "i"}]}}  # fmt: skip
    bad = {**good, "spec": {"containers": [{"name": "c", "image": "i", "mounts": []}]}}
    for version in (OLDEST, NEWEST):
        kubernetes_validate.validate(good, version, strict=True)
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, version, strict=True)
        assert _validates(good, version) is None and _validates(bad, version) is not None


def test_every_source_contributes_fixtures() -> None:
    by_source = {s: sum(f.id.startswith(s + "/") for f in FIXTURES) for s in ("testdata", "pod")}
    by_source["shapes"] = sum(f.id.startswith("shapes/") for f in FIXTURES)
    assert by_source["testdata"] >= 20 and by_source["pod"] >= 21 and by_source["shapes"] >= 30
    assert OLDEST == "1.29.0" and NEWEST >= "1.33.0"


def property_problems(fx: Fixture, result: Injection) -> list[str]:
    """What ``result`` (the injector's output for ``fx``) breaks of the property: one line a
    problem, each starting with the leg that found it (``structure/delivery``, ``schema``,
    ``exec``, ``skip``)."""
    if not result.decision.inject:  # skipped: nothing but the annotation changes
        if result.pod.get("spec") != fx.template.get("spec"):
            return ["skip: a skipped pod's spec changed"]
        return []
    problems = []
    intent = intent_of(result.decision)
    verdict = verify(fx.template, result.pod, intent)
    if not verdict.ok:
        problems.append(f"structure/delivery: {verdict.summary()}")
    for version in (OLDEST, NEWEST):
        if _validates(as_pod(fx.template), version) is None:
            problem = _validates(as_pod(result.pod), version)
            if problem is not None:
                problems.append(f"schema: Kubernetes {version} rejects the injected pod: {problem}")
    run = run_delivery(as_pod(result.pod), intent, fx.configmaps)
    if fx.unverifiable is not None:
        if not (run.status == UNVERIFIED and fx.unverifiable in run.message):
            problems.append(f"exec: expected unverifiable ({fx.unverifiable}), got {run}")
    elif not run.ok:
        problems.append(f"exec: {run.status}: {run.message}; engine argv: {run.engine_argv}")
    return problems


@pytest.mark.parametrize("fx", FIXTURES, ids=lambda f: f.id)
def test_injected_pod_satisfies_the_property(fx: Fixture) -> None:
    result = inject_pod(fx.template, fx.policies, DEFAULTS, fx.group_size)
    problems = property_problems(fx, result)
    assert not problems, "\n".join(problems)


def test_every_injected_fixture_meets_the_schema_at_both_versions() -> None:
    """The schema leg is skipped for an input the API server would refuse already; no fixture
    needs that today, so the leg runs on every injected pod."""
    injected = [
        fx
        for fx in FIXTURES
        if inject_pod(fx.template, fx.policies, DEFAULTS, fx.group_size).decision.inject
    ]
    refused = [
        (fx.id, version)
        for fx in injected
        for version in (OLDEST, NEWEST)
        if _validates(as_pod(fx.template), version) is not None
    ]
    assert not refused, refused


# -- the property's checks can fail: broken renderings, each caught by the leg named -----------
RENDER = inject_pkg.render


def _vllm(pod: dict[str, Any], decision: Any) -> dict[str, Any]:
    return next(c for c in pod["spec"]["containers"] if c["name"] == decision.container)


def _twice_mounted(pod: Any, decision: Any, defaults: Any) -> dict[str, Any]:
    out = RENDER(pod, decision, defaults)
    _vllm(out, decision)["volumeMounts"].append(
        {"name": "kvoffload-run", "mountPath": "/kvoffload/pool"}
    )
    return out


def _unknown_field(pod: Any, decision: Any, defaults: Any) -> dict[str, Any]:
    out = RENDER(pod, decision, defaults)
    out["spec"]["initContainers"][-1]["volumeMount"] = []  # a typo the API server refuses
    return out


def _quoted_once(pod: Any, decision: Any, defaults: Any) -> dict[str, Any]:
    """The JSON quoted for one shell parse where the text is parsed twice (eval)."""
    edit = dataclasses.replace(decision.edit, parse=Parse.ONCE)
    return RENDER(pod, dataclasses.replace(decision, edit=edit), defaults)


def _flag_twice(pod: Any, decision: Any, defaults: Any) -> dict[str, Any]:
    out = RENDER(pod, decision, defaults)
    config = json.dumps(kv_transfer_config(decision.policy), separators=(",", ":"))
    vllm = _vllm(out, decision)
    vllm["args"] = [*(vllm.get("args") or []), f"--kv-transfer-config={config}"]
    return out


def _by_id(prefix: str) -> Fixture:
    return next(fx for fx in FIXTURES if fx.id.startswith(prefix))


@pytest.mark.parametrize(
    ("fixture", "renderer", "legs"),
    [
        ("testdata/deployment-command/", _twice_mounted,
         {"structure/delivery": "unique-mount-paths"}),
        ("testdata/deployment-command/", _unknown_field, {"schema": "volumeMount"}),
        ("testdata/kserve-llmisvc-eval/", _quoted_once,
         {"structure/delivery": "flag-json", "exec": "is not JSON"}),
        ("testdata/job-run-batch/", _flag_twice,
         {"structure/delivery": "flag-once", "exec": "2 times"}),
    ],
    ids=["mount-path-twice", "schema", "eval-quoted-once", "flag-twice"],
)  # fmt: skip
def test_the_property_catches_a_broken_rendering(
    fixture: str, renderer: Any, legs: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fx = _by_id(fixture)
    assert property_problems(fx, inject_pod(fx.template, fx.policies, DEFAULTS)) == []
    monkeypatch.setattr(inject_pkg, "render", renderer)
    problems = property_problems(fx, inject_pod(fx.template, fx.policies, DEFAULTS))
    for leg, words in legs.items():
        assert any(p.startswith(leg + ":") and words in p for p in problems), problems
    assert {p.split(":", 1)[0] for p in problems} == set(legs), problems


def test_the_exec_leg_sees_what_the_pure_checks_cannot() -> None:
    """A script from a ConfigMap that drops its arguments (`inject-via: args` said wrongly):
    only running it shows the engine never gets the flag."""
    template = {
        "metadata": {"name": "x", "annotations": {"kvoffload.io/inject-via": "args"}},
        "spec": {
            "containers": [{"name": "vllm", "image": "example.com/app:1",
                            "command": ["bash", "/scripts/start.sh"],
                            "volumeMounts": [{"name": "s", "mountPath": "/scripts"}]}],
            "volumes": [{"name": "s", "configMap": {"name": "start"}}],
        },
    }  # fmt: skip
    fx = Fixture("drops-its-args", template, [shapes.POLICY],
                 configmaps={"start": {"start.sh": "exec vllm serve m\n"}})  # fmt: skip
    problems = property_problems(fx, inject_pod(template, fx.policies, DEFAULTS))
    assert problems == [f"exec: failed: the engine got --kv-transfer-config 0 times; "
                        f"engine argv: {('vllm', 'serve', 'm')}"], problems  # fmt: skip


def test_the_whole_property_runs_in_seconds() -> None:
    """The pure checks are what every admission pays: milliseconds a pod at most (shlex over
    KServe's 200-line scripts is the slowest part)."""
    injected = [
        (fx, r)
        for fx in FIXTURES
        if (r := inject_pod(fx.template, fx.policies, DEFAULTS, fx.group_size)).decision.inject
    ]
    assert len(injected) >= 30
    start = time.perf_counter()
    for fx, r in injected:
        verify(fx.template, r.pod, intent_of(r.decision))
    per_pod = (time.perf_counter() - start) / len(injected)
    assert per_pod < 0.02, f"{per_pod * 1e3:.2f} ms a pod"
