"""Acceptance against a real cluster (marker `cluster`; skipped unless KUBECONFIG is set).

helm-installs the chart into a temporary namespace, waits for the operator, opts a second
namespace in, applies a policy, and checks that a vLLM-like pod gets the sidecar: first through a
server-side dry run (admission runs, nothing is created), then for a real pod. Everything it
created is deleted at the end (the CRD stays: helm never deletes CRDs).

Images: KVOFFLOAD_TEST_IMAGE (repository:tag of images/Dockerfile) must be pullable by the
cluster; the vLLM pod's image is never pulled before the assertion.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvoffload"
SIDECAR = "kvoffload-sidecar"


@pytest.fixture(scope="module")
def cluster(request):
    if not os.environ.get("KUBECONFIG"):
        pytest.skip("KUBECONFIG is not set: no cluster to install into")
    image = os.environ.get("KVOFFLOAD_TEST_IMAGE")
    if not image:
        pytest.skip("KVOFFLOAD_TEST_IMAGE (the kvoffload image, repository:tag) is not set")
    tools = request.getfixturevalue("tools")
    suffix = uuid.uuid4().hex[:6]
    release_ns, app_ns, release = f"kvo-sys-{suffix}", f"kvo-app-{suffix}", f"kvo-{suffix}"

    def run(*cmd: str, timeout: int = 120, check: bool = True, stdin: str | None = None) -> str:
        proc = subprocess.run(
            [*cmd], input=stdin, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
        return proc.stdout

    kubectl = lambda *a, **kw: run(str(tools.kubectl), *a, **kw)  # noqa: E731
    helm = lambda *a, **kw: run(str(tools.helm), *a, **kw)  # noqa: E731
    repository, _, tag = image.rpartition(":")
    try:
        helm(
            "install",
            release,
            str(CHART),
            "--namespace",
            release_ns,
            "--create-namespace",
            "--set",
            f"image.repository={repository}",
            "--set-string",
            f"image.tag={tag}",
            "--set",
            "operator.replicas=1",
            "--set",
            "monitoring.dashboard.enabled=false",
            "--wait",
            "--timeout",
            "5m",
            timeout=330,
        )
        kubectl("create", "namespace", app_ns)
        kubectl("label", "namespace", app_ns, "kvoffload.io/injection=enabled")
        yield {"kubectl": kubectl, "app_ns": app_ns, "release_ns": release_ns}
    finally:
        kubectl("delete", "namespace", app_ns, "--ignore-not-found", "--wait=false", check=False)
        helm("uninstall", release, "--namespace", release_ns, "--wait", timeout=180, check=False)
        kubectl(
            "delete", "namespace", release_ns, "--ignore-not-found", "--wait=false", check=False
        )


POLICY = """
apiVersion: kvoffload.io/v1alpha1
kind: KVOffloadPolicy
metadata:
  name: acceptance
spec:
  selector:
    matchLabels:
      app: vllm-acceptance
  pool:
    size: 64Mi
"""


def _pod(name: str) -> str:
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "vllm-acceptance"}},
        "spec": {
            "containers": [
                {
                    "name": "vllm",
                    "image": "vllm/vllm-openai:latest",
                    "command": ["vllm", "serve", "facebook/opt-125m"],
                }
            ]
        },
    }
    return json.dumps(pod)


def _init_names(pod: dict[str, Any]) -> list[str]:
    return [c["name"] for c in pod["spec"].get("initContainers", [])]


def test_operator_is_ready(cluster):
    out = cluster["kubectl"]("get", "deployments", "-n", cluster["release_ns"], "-o", "json")
    (deploy,) = json.loads(out)["items"]
    assert deploy["status"].get("readyReplicas") == deploy["spec"]["replicas"]


def test_vllm_pod_in_an_opted_in_namespace_gets_the_sidecar(cluster):
    kubectl, ns = cluster["kubectl"], cluster["app_ns"]
    kubectl("apply", "-n", ns, "-f", "-", stdin=POLICY)
    # The webhook learns policies from a watch: retry the dry run until it has seen this one.
    deadline, injected = time.monotonic() + 90, []
    while time.monotonic() < deadline:
        out = kubectl(
            "create", "-n", ns, "--dry-run=server", "-o", "json", "-f", "-", stdin=_pod("p0")
        )
        injected = _init_names(json.loads(out))
        if SIDECAR in injected:
            break
        time.sleep(3)
    assert SIDECAR in injected
    created = json.loads(kubectl("create", "-n", ns, "-o", "json", "-f", "-", stdin=_pod("p1")))
    assert SIDECAR in _init_names(created)
    assert created["metadata"]["labels"].get("kvoffload.io/injected") == "true"


def test_pod_outside_opted_in_namespaces_is_left_alone(cluster):
    out = cluster["kubectl"](
        "create",
        "-n",
        cluster["release_ns"],
        "--dry-run=server",
        "-o",
        "json",
        "-f",
        "-",
        stdin=_pod("p2"),
    )
    assert SIDECAR not in _init_names(json.loads(out))
