"""Against a real API server (KUBECONFIG): the CRD applies, good policies are accepted
(server-side dry run), bad ones are rejected with their message. Skipped without a cluster."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.crds.test_crd_schema import BAD, CRD_PATH, GOOD, _header

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="needs KUBECONFIG"),
    pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl on PATH"),
]


def kubectl(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["kubectl", *args], input=stdin, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.fixture(scope="module", autouse=True)
def crd_installed() -> None:
    res = kubectl("apply", "--server-side", "-f", str(CRD_PATH))
    assert res.returncode == 0, res.stderr
    res = kubectl(
        "wait", "--for=condition=Established", "--timeout=30s", "crd/kvoffloadpolicies.kvoffload.io"
    )
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("path", GOOD, ids=lambda p: p.name)
def test_good_policy_is_accepted(path: Path) -> None:
    res = kubectl("apply", "--dry-run=server", "-n", "default", "-f", str(path))
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.name)
def test_bad_policy_is_rejected(path: Path) -> None:
    res = kubectl("apply", "--dry-run=server", "-n", "default", "-f", str(path))
    assert res.returncode != 0
    expected = _header(path, "expect")
    # schema messages are worded by the API server, CEL messages are ours verbatim
    if "Invalid value" in res.stderr and expected[:1].islower() and "." in expected:
        assert expected in res.stderr
