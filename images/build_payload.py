"""Build the connector payload (what images/connector.Dockerfile ships as /payload).

Layout, chosen so the payload can never shadow a package the vLLM image ships (the init
container copies it into a folder at the FRONT of vLLM's PYTHONPATH):

    <out>/kvoffload_connector/        our connector, at top level
    <out>/kvoffload/                  our gRPC stubs (kvoffload.v1), at top level
    <out>/_kvoffload_deps/cp3XY/      grpcio, grpcio-health-checking, protobuf (and what they
                                      need) for CPython 3.XY, one folder per minor version

Nothing else is at top level. The deps folders are never on PYTHONPATH: the connector appends
the one matching its interpreter to the END of sys.path (guard.add_payload_deps), so the image's
own grpc/protobuf win and ours only fill gaps. One payload image serves vLLM images of any
CPython minor in --pythons.

    python images/build_payload.py OUT --source . --pythons 3.10 3.11 3.12 3.13 \
        --grpcio 1.85.1 --protobuf 7.36.2

Standard library only (it runs in the Dockerfile's build stage and in tests).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

PACKAGES = {  # payload top-level name -> source folder under the repository root
    "kvoffload_connector": "connector/kvoffload_connector",
    "kvoffload": "protos/gen/kvoffload",
}
DEPS_DIR = "_kvoffload_deps"
PLATFORM = "manylinux2014_x86_64"


def deps_folder(out: Path, python: str) -> Path:
    return out / DEPS_DIR / ("cp" + python.replace(".", ""))


def copy_packages(source: Path, out: Path) -> None:
    for name, rel in PACKAGES.items():
        shutil.copytree(
            source / rel, out / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
        )


def install_deps(
    out: Path,
    python: str,
    requirements: list[str],
    pip: list[str],
    platform: str | None,
    options: list[str],
) -> None:
    """Binary wheels for CPython ``python`` into its deps folder (for another interpreter than
    the one running pip, --python-version/--platform pick the wheels; none is ever compiled)."""
    target = deps_folder(out, python)
    cmd = [*pip, "install", *options, "--quiet", "--target", str(target), "--only-binary=:all:"]
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if python != here or platform:
        cmd += ["--python-version", python, "--implementation", "cp"]
        cmd += ["--platform", platform or PLATFORM]
    subprocess.run([*cmd, *requirements], check=True)
    shutil.rmtree(target / "bin", ignore_errors=True)


def build(
    out: Path,
    source: Path,
    pythons: list[str],
    requirements: list[str],
    pip: list[str] | None = None,
    platform: str | None = None,
    pip_options: list[str] | None = None,
) -> None:
    """``pip_options``: extra ``pip install`` options (e.g. ``--no-index --find-links DIR``)."""
    out.mkdir(parents=True, exist_ok=True)
    copy_packages(source, out)
    for python in pythons:
        pip = pip or [sys.executable, "-m", "pip"]
        install_deps(out, python, requirements, pip, platform, pip_options or [])
    for cache in out.rglob("__pycache__"):
        shutil.rmtree(cache, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--source", type=Path, default=Path("."))
    parser.add_argument("--pythons", nargs="+", default=["3.10", "3.11", "3.12", "3.13"])
    parser.add_argument("--grpcio", required=True, help="grpcio and grpcio-health-checking")
    parser.add_argument("--protobuf", required=True)
    parser.add_argument("--platform", default=PLATFORM)
    args = parser.parse_args(argv)
    requirements = [
        f"grpcio=={args.grpcio}",
        f"grpcio-health-checking=={args.grpcio}",
        f"protobuf=={args.protobuf}",
    ]
    build(args.out, args.source, args.pythons, requirements, platform=args.platform)
    return 0


if __name__ == "__main__":
    sys.exit(main())
