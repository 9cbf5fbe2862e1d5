"""Generate the Python gRPC stubs from protos/ into protos/gen (or check they are fresh).

Kept as a script so `make protos` and the staleness check run the very same code.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc


def generate(src: Path, out: Path) -> list[Path]:
    protos = sorted(src.glob("kvoffload/**/*.proto"))
    if not protos:
        sys.exit(f"no .proto files under {src}/kvoffload")
    out.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{src}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *map(str, protos),
    ]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")
    # Regular packages, so setuptools and mypy see them.
    for proto in protos:
        pkg = out / proto.relative_to(src).parent
        while pkg != out:
            (pkg / "__init__.py").touch()
            pkg = pkg.parent
    return sorted(
        p.relative_to(out) for p in out.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail when the stubs in OUT are stale")
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    ns = parser.parse_args()
    if not ns.check:
        files = generate(ns.src, ns.out)
        print(f"generated {len(files)} files under {ns.out}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(ns.src, Path(tmp))
        current = sorted(
            p.relative_to(ns.out)
            for p in ns.out.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        )
        stale = [
            str(f)
            for f in fresh
            if not (ns.out / f).exists()
            or not filecmp.cmp(Path(tmp) / f, ns.out / f, shallow=False)
        ]
        extra = [str(f) for f in current if f not in fresh]
        if stale or extra:
            sys.exit(
                f"protos/gen is stale (differs: {stale}, not generated: {extra}); run 'make protos'"
            )
    print("protos/gen is up to date")


if __name__ == "__main__":
    main()
