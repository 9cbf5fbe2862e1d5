"""Generate the Python gRPC stubs from protos/ into protos/gen (or check they are fresh).

Kept as a script so `make protos` and the staleness check run the very same code.

Post-processing (`relax_runtime_checks`): protoc stamps the message stubs with a check that
refuses any protobuf runtime older than the generator's (7.x), and the gRPC stubs with one that
refuses grpcio older than grpcio-tools. The connector runs inside vLLM images, which carry
protobuf 5.29-6.x (vLLM requires protobuf>=5.29.6) and their own grpcio. The generated code only
uses APIs those runtimes have (tests/chart/test_payload_protobuf_compat.py round-trips messages
and a real gRPC call on protobuf 5.29.6 and 6.33.5 with grpcio 1.66), so the checks are replaced
with floors of ours: protobuf>=5.29 and grpcio>=1.66 (pyproject.toml says the same).
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.resources
import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

PROTOBUF_FLOOR = (5, 29)
GRPC_FLOOR = "1.66.0"
_VALIDATE = re.compile(
    r"from google\.protobuf import runtime_version as _runtime_version\n"
    r"(?P<mid>(?:.*\n)*?)"
    r"_runtime_version\.ValidateProtobufRuntimeVersion\(\n(?:.*\n)*?\)\n"
)
_FLOOR_CHECK = """from google.protobuf import __version__ as _protobuf_version
{mid}if tuple(int(p) for p in _protobuf_version.split(".")[:2]) < {floor}:
  raise ImportError(
    f"kvoffload stubs need protobuf>={major}.{minor}, found {{_protobuf_version}}"
  )
"""


def relax_runtime_checks(out: Path) -> None:
    """Replace protoc's exact-runtime checks with our floors (see the module docstring)."""
    for path in out.rglob("*_pb2.py"):
        text = path.read_text()
        new, n = _VALIDATE.subn(
            lambda m: _FLOOR_CHECK.format(
                mid=m["mid"],
                floor=PROTOBUF_FLOOR,
                major=PROTOBUF_FLOOR[0],
                minor=PROTOBUF_FLOOR[1],
            ),
            text,
        )
        if n != 1:
            sys.exit(f"{path}: protoc's runtime version check not found; update gen_protos.py")
        path.write_text(new)
    for path in out.rglob("*_pb2_grpc.py"):
        text = path.read_text()
        new, n = re.subn(
            r"^GRPC_GENERATED_VERSION = '[^']*'$",
            f"GRPC_GENERATED_VERSION = '{GRPC_FLOOR}'",
            text,
            flags=re.M,
        )
        if n != 1:
            sys.exit(f"{path}: GRPC_GENERATED_VERSION not found; update gen_protos.py")
        path.write_text(new)


def generate(src: Path, out: Path) -> list[Path]:
    protos = sorted(src.glob("kvoffload/**/*.proto"))
    if not protos:
        sys.exit(f"no .proto files under {src}/kvoffload")
    out.mkdir(parents=True, exist_ok=True)
    # protobuf's own .proto files (descriptor, wrappers, timestamp: the vendored csi.proto)
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{src}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *map(str, protos),
    ]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")
    relax_runtime_checks(out)
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
