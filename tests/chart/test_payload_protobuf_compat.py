"""Our generated stubs on the protobuf/grpcio runtimes vLLM images carry (the payload's deps come
last on sys.path, so an image's own older protobuf is the one the connector gets).

vLLM requires protobuf>=5.29.6; images carry 5.29-6.x. tools/gen_protos.py relaxes protoc's
exact-runtime checks to floors (protobuf>=5.29, grpcio>=1.66); this proves the stubs then work:
messages round-trip and a real gRPC call over a Unix socket succeeds, in a fresh interpreter whose
only protobuf/grpcio are the old ones (installed by pip into .cache/, reused on reruns).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "protobuf-compat"
RUNTIMES = {
    "protobuf-5.29.6": ["protobuf==5.29.6", "grpcio==1.66.0"],
    "protobuf-6.33.5": ["protobuf==6.33.5", "grpcio==1.66.0"],
}
TOO_OLD = ["protobuf==4.25.8"]

CLIENT_SERVER = r"""
import sys, tempfile, os
from concurrent import futures
import google.protobuf, grpc
from kvoffload.v1 import pool_pb2, pool_pb2_grpc

assert "site-packages" not in google.protobuf.__file__, google.protobuf.__file__
req = pool_pb2.RegisterRequest(num_ranks=2, client_name="c")
req.spec.model = "m"; req.spec.extra["k"] = "v"
assert pool_pb2.RegisterRequest.FromString(req.SerializeToString()) == req
sess = pool_pb2.SessionRequest(seq=3); sess.reserve_load.keys = b"\x01\x02"
assert sess.WhichOneof("call") == "reserve_load"

class Pool(pool_pb2_grpc.KVPoolServicer):
    def Stats(self, request, context):
        return pool_pb2.StatsResponse(pool_bytes=123, version="v")
    def Session(self, requests, context):
        for r in requests:
            yield pool_pb2.SessionResponse(seq=r.seq)

path = os.path.join(tempfile.mkdtemp(), "pool.sock")
server = grpc.server(futures.ThreadPoolExecutor(2))
pool_pb2_grpc.add_KVPoolServicer_to_server(Pool(), server)
server.add_insecure_port("unix://" + path)
server.start()
with grpc.insecure_channel("unix://" + path) as channel:
    stub = pool_pb2_grpc.KVPoolStub(channel)
    stats = stub.Stats(pool_pb2.StatsRequest(), timeout=10)
    assert (stats.pool_bytes, stats.version) == (123, "v")
    seqs = [r.seq for r in stub.Session(iter([pool_pb2.SessionRequest(seq=i) for i in (1, 2)]))]
    assert seqs == [1, 2]
server.stop(0)
print(google.protobuf.__version__, grpc.__version__)
"""


def _install(name: str, requirements: list[str]) -> Path:
    target = CACHE / name
    if not (target / ".done").exists():
        res = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--only-binary=:all:",
             "--target", str(target), *requirements],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if res.returncode != 0:
            pytest.skip(f"cannot install {requirements}: {res.stderr[-500:]}")
        (target / ".done").touch()
    return target


def _python(code: str, *path: Path) -> subprocess.CompletedProcess[str]:
    # -S: no site-packages at all, so the only protobuf/grpcio are the ones on PYTHONPATH
    return subprocess.run(
        [sys.executable, "-S", "-c", code],
        env={"PYTHONPATH": ":".join(map(str, [REPO / "protos" / "gen", *path]))},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.process
@pytest.mark.parametrize("name", sorted(RUNTIMES))
def test_stubs_work_on_the_runtimes_vllm_images_carry(name: str) -> None:
    runtime = _install(name, RUNTIMES[name])
    res = _python(CLIENT_SERVER, runtime)
    assert res.returncode == 0, res.stderr[-3000:]
    protobuf_version, grpc_version = res.stdout.split()
    assert (protobuf_version, grpc_version) == tuple(r.split("==")[1] for r in RUNTIMES[name])


@pytest.mark.process
def test_stubs_refuse_a_protobuf_older_than_the_floor_clearly() -> None:
    runtime = _install("protobuf-4.25.8", TOO_OLD)
    res = _python("from kvoffload.v1 import pool_pb2", runtime)
    assert res.returncode != 0
    assert "kvoffload stubs need protobuf>=5.29, found 4.25.8" in res.stderr


def test_pyproject_floors_match_the_generator() -> None:
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.replace(" ", "").startswith("protobuf>=5.29") for d in deps), deps
    assert any(d.replace(" ", "").startswith("grpcio>=1.66") for d in deps), deps
