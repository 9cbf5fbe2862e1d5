"""Every uid of the pod can use the pool: the sidecar runs as 65532 (as injected), vLLM as
another uid (1000 with gid 0, like OpenShift's arbitrary uids), and both sockets let it in."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import kvoffload_command, short_dir, wait_serving

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]

SIDECAR_UID = 65532
VLLM_UID = 1000

# Run as the vLLM uid: a real Register + Stats over gRPC, then an attach on the framed socket.
CLIENT = textwrap.dedent(
    """
    import socket, struct, sys
    import grpc
    from kvoffload.v1 import pool_pb2 as pb, pool_pb2_grpc as pb_grpc
    sock = sys.argv[1]
    with grpc.insecure_channel("unix:" + sock) as ch:
        stub = pb_grpc.KVPoolStub(ch)
        reg = stub.Register(pb.RegisterRequest(
            spec=pb.NamespaceSpec(model="m", dtype="bfloat16", kv_layout="LBHNC/packed-kv",
                                  block_size=16, chunk_blocks=1, tp_size=1, hash_algo="sha256",
                                  key_size=32),
            num_ranks=1, slot_bytes_per_rank=65536, client_name="uid-test"), timeout=10)
        stats = stub.Stats(pb.StatsRequest(), timeout=10)
    assert len(stats.namespaces) == 1, stats
    region = reg.regions[0]
    with open(region.path, "r+b") as pool:  # the pool file too: vLLM maps it
        pool.write(b"x")
    framed = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    framed.settimeout(10)
    framed.connect(sock.rsplit("/", 1)[0] + "/" + reg.session_socket)
    msg = pb.SessionRequest(seq=1, attach=pb.AttachRequest(client_id=reg.client_id))
    body = msg.SerializeToString()
    framed.sendall(struct.pack("<I", len(body)) + body)
    size = struct.unpack("<I", framed.recv(4, socket.MSG_WAITALL))[0]
    reply = pb.SessionResponse.FromString(framed.recv(size, socket.MSG_WAITALL))
    assert reply.WhichOneof("result") == "attach", reply
    print("ok", reg.session_socket)
    """
)


def as_uid(uid: int, gid: int) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"]


def can_switch_uid() -> bool:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return False
    return subprocess.run([*as_uid(VLLM_UID, 0), "true"], check=False).returncode == 0


@pytest.fixture
def pod_dirs() -> Iterator[tuple[Path, Path]]:
    """A pool dir and a run dir as emptyDirs are: mode 0777, owned by root."""
    base = short_dir()
    pool, run = base / "pool", base / "run"
    for d in (base, pool, run):
        d.mkdir(exist_ok=True)
        d.chmod(0o777)
    try:
        yield pool, run
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.skipif(not can_switch_uid(), reason="needs root and setpriv to switch uids")
def test_another_uid_registers_and_opens_a_framed_session(pod_dirs: tuple[Path, Path]) -> None:
    pool, run = pod_dirs
    sock = run / "kvoffload.sock"
    log = run / "sidecar.log"
    argv = [
        *as_uid(SIDECAR_UID, SIDECAR_UID),
        *kvoffload_command(),
        "sidecar",
        "--pool-size=16Mi",
        f"--pool-dir={pool}",
        f"--socket={sock}",
        "--file-mode=0666",  # what the injector passes: vLLM runs as another uid of the pod
    ]
    with open(log, "wb") as err:
        proc = subprocess.Popen(argv, stdout=err, stderr=err)
    try:
        wait_serving(f"unix:{sock}", 30, alive=lambda: proc.poll() is None)
        for path in (sock, run / "kvoffload.sock.session", pool / "pool-0.shm"):
            assert stat.S_IMODE(path.stat().st_mode) == 0o666, (path, oct(path.stat().st_mode))
            assert path.stat().st_uid == SIDECAR_UID
        done = subprocess.run(
            [*as_uid(VLLM_UID, 0), sys.executable, "-c", CLIENT, str(sock)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, f"{done.stderr}\n--- sidecar ---\n{log.read_text()}"
        assert done.stdout.split() == ["ok", "kvoffload.sock.session"]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, log.read_text()
