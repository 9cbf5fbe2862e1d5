"""Against a real API server (KUBECONFIG): what `kvoffload inject` renders is accepted by the
API server (server-side dry run: native sidecar, probes, hugepages, securityContext), and a
policy applies and lists with its printer columns. Skipped without a cluster."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.operator.golden import IMAGE_ARGS, cases

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="needs KUBECONFIG"),
    pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl on PATH"),
]
NS = "kvoffload-cluster-test"


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args), input=stdin, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.fixture(scope="module", autouse=True)
def namespace() -> None:
    res = run("kubectl", "apply", "--server-side", "-f", str(ROOT / "crds/kvoffloadpolicy.yaml"))
    assert res.returncode == 0, res.stderr
    run(
        "kubectl",
        "wait",
        "--for=condition=Established",
        "--timeout=30s",
        "crd/kvoffloadpolicies.kvoffload.io",
    )
    run("kubectl", "create", "namespace", NS)
    yield
    run("kubectl", "delete", "namespace", NS, "--wait=false")


@pytest.mark.parametrize(
    "case", [c for c in cases() if c.name != "lws-with-others"], ids=lambda c: c.name
)
def test_injected_manifests_pass_server_side_validation(case) -> None:
    exe = str(Path(sys.executable).with_name("kvoffload"))
    rendered = run(
        exe, "inject", "-f", str(case.input), "--policy", str(case.policy_file), *IMAGE_ARGS
    )
    assert rendered.returncode == 0, rendered.stderr
    res = run("kubectl", "apply", "--dry-run=server", "-n", NS, "-f", "-", stdin=rendered.stdout)
    assert res.returncode == 0, res.stderr


def test_policy_applies_and_lists() -> None:
    text = (ROOT / "crds/examples/minimal.yaml").read_text()
    res = run(
        "kubectl",
        "apply",
        "-f",
        "-",
        stdin=text.replace("namespace: inference", f"namespace: {NS}"),
    )
    assert res.returncode == 0, res.stderr
    listed = run("kubectl", "get", "kvop", "-n", NS)
    assert listed.returncode == 0 and "POOL" in listed.stdout and "16Gi" in listed.stdout
    header = listed.stdout.splitlines()[0].split()
    assert header[header.index("READY") + 1 : header.index("READY") + 3] == ["CAPACITY", "USED"]
