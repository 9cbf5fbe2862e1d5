"""`helm lint` and `helm template` over several value sets, manifests validated against the
Kubernetes 1.29 and 1.33 OpenAPI schemas (kubernetes-validate, strict), kubeVersion enforcement,
and the chart's CRD copy.

kubernetes-validate checks field names and types only (it accepted `sideEffects: Maybe` in the
reference notes), so enum-like fields are asserted in test_chart_render.py instead.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from chart_value_sets import VALUE_SETS

pytestmark = pytest.mark.process

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvoffload"
K8S_VERSIONS = ("1.29.0", "1.33.0")
# Custom resources the chart may render: kubernetes-validate has no schema for them (the CRD owners
# validate them; KVOffloadPolicy against our CRD in test_chart_render.py).
CUSTOM_KINDS = {
    "Issuer",
    "Certificate",
    "ServiceMonitor",
    "PodMonitor",
    "KVOffloadPolicy",
    "KVOffloadNodePool",  # checked against its CRD in test_chart_node_agent.py
    "ClusterKopfPeering",
    "KopfPeering",
}


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_helm_lint_strict_passes(helm, name):
    result = helm(
        "lint", "--strict", str(CHART), "--namespace", "kvoffload-system", *VALUE_SETS[name]
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_helm_template_renders_named_objects(render, name):
    objs = render(*VALUE_SETS[name])
    kinds = {o["kind"] for o in objs}
    assert {
        "Deployment",
        "Service",
        "ServiceAccount",
        "MutatingWebhookConfiguration",
        "ClusterRole",
    } <= kinds
    assert all(o["metadata"]["name"] for o in objs)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_rendered_manifests_validate_strictly(render, name, version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    objs = render(*VALUE_SETS[name], "--kube-version", version)
    errors, unchecked = [], set()
    for obj in objs:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            unchecked.add(obj["kind"])
        except kubernetes_validate.ValidationError as exc:
            errors.append(
                f"{obj['kind']}/{obj['metadata']['name']}: {exc.message} at {list(exc.path)}"
            )
    assert not errors, "\n".join(errors)
    assert unchecked <= CUSTOM_KINDS, f"no schema for built-in kinds {unchecked - CUSTOM_KINDS}"


def test_strict_validation_catches_a_misplaced_field(render):
    """Control for the test above: a field in the wrong place must fail strict validation."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    deploy: dict[str, Any] = copy.deepcopy(next(o for o in render() if o["kind"] == "Deployment"))
    deploy["spec"]["template"]["spec"]["containers"][0]["readOnlyRootFilesystem"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deploy, "1.33.0", strict=True)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_crd_validates_against_the_cluster_schema(helm, version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    import yaml

    if not (CHART / "crds" / "kvoffloadpolicy.yaml").exists():
        pytest.skip("charts/kvoffload/crds/ not generated yet (make crds-sync)")
    result = helm("template", "kv", str(CHART), "--include-crds", "--kube-version", version)
    assert result.returncode == 0, result.stderr
    crds = {
        o["metadata"]["name"]: o
        for o in yaml.safe_load_all(result.stdout)
        if o and o["kind"] == "CustomResourceDefinition"
    }
    assert "kvoffloadpolicies.kvoffload.io" in crds
    for crd in crds.values():  # ours from crds/, kopf's peering CRDs from templates/
        kubernetes_validate.validate(crd, version, strict=True)


def test_kube_version_below_1_29_is_refused(helm):
    """Native sidecars need 1.29+; `helm lint` ignores kubeVersion, `helm template` enforces it."""
    old = helm("template", "kv", str(CHART), "--kube-version", "1.28.9")
    new = helm("template", "kv", str(CHART), "--kube-version", "1.29.0")
    assert old.returncode != 0 and "kubeVersion" in old.stderr, old.stderr
    assert new.returncode == 0, new.stderr


def test_chart_crd_equals_the_source():
    source = REPO / "crds" / "kvoffloadpolicy.yaml"
    if not source.exists():
        pytest.skip("crds/kvoffloadpolicy.yaml not written yet")
    copy_ = CHART / "crds" / "kvoffloadpolicy.yaml"
    assert copy_.exists(), "charts/kvoffload/crds/kvoffloadpolicy.yaml missing: run make crds-sync"
    assert copy_.read_bytes() == source.read_bytes(), "chart CRD is stale: run make crds-sync"
