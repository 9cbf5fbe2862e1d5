"""Peer attestation: the agent places a connecting process in its pod by the kernel's cgroup
path and refuses a process of another pod even where the filesystem let it reach the socket:
`memory.sock`, `pool.sock` and `session.sock` alike. And a pod's `pool.sock` holds a bounded
number of connections, attested or not."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from kvoffload.v1 import pool_pb2 as pb
from kvoffload.v1 import pool_pb2_grpc as pb_grpc
from kvoffload_connector.common.node_memory import NodeMemoryError, open_tenant_memory
from kvoffload_sidecar.node.attest import MAX_OUTSIDERS_PER_SOCKET, NOT_IN_POD, pod_uid_of_cgroup
from kvoffload_sidecar.node.pools import PoolOptions
from kvoffload_sidecar.node.tenant_memory import MAX_CONNECTIONS_PER_SOCKET
from nodeharness import POD_A, POD_B, MiB, Node, pool_call
from slot_client import Pod as SlotPod
from slot_client import call as framed_call

UID = "0f3c6a2e-57b1-4c3e-9d55-0c2b5f1e8a10"


@pytest.mark.parametrize(
    "text",
    [
        # cgroup v2, systemd driver
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
        f"{UID.replace('-', '_')}.slice/cri-containerd-0123abcd.scope\n",
        # cgroup v2, cgroupfs driver (Guaranteed pods sit under /kubepods directly)
        f"0::/kubepods/pod{UID}/0123abcd\n",
        # cgroup v1: one line per controller
        f"12:memory:/kubepods/besteffort/pod{UID}/0123abcd\n11:cpu:/kubepods/besteffort/pod{UID}/x\n",
    ],
)
def test_a_pods_cgroup_names_its_uid(text: str) -> None:
    assert pod_uid_of_cgroup(text) == UID


@pytest.mark.parametrize(
    "text",
    [
        "0::/\n",  # a host process
        "0::/system.slice/containerd.service\n",
        f"0::/kubepods/pod{UID}/a\n1:memory:/kubepods/pod{UID[:-1]}f/a\n",  # two pods: ambiguous
        f"0::/kubepods/pod{UID}x/a\n",  # not a uid boundary
    ],
)
def test_no_pod_or_several_places_nobody(text: str) -> None:
    assert pod_uid_of_cgroup(text) is None


OTHER_UID = 4242  # a process of no pod, another uid than the agent's


@pytest.fixture(scope="module")
def attesting() -> Iterator[Node]:
    """One attesting agent with pods A and B published; this test process is "in" pod A for
    it (its cgroup file under a stand-in proc root, systemd driver), every other pid in none."""
    with tempfile.TemporaryDirectory(prefix="kvo-proc-") as proc:
        mine = Path(proc) / str(os.getpid())
        mine.mkdir()
        (mine / "cgroup").write_text(
            "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod"
            f"{POD_A.uid.replace('-', '_')}.slice/cri-containerd-1.scope\n"
        )
        attest = ("--attest-peers", "cgroup", "--proc-root", proc)
        with Node(POD_A, POD_B, holder=False, agent_args=attest) as node:
            yield node
            node.kubelet.unpublish(POD_A)
            node.kubelet.unpublish(POD_B)


def _outside(code: str) -> list[str]:
    """`code` in a process of another uid that no pod's cgroup holds: its printed words."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        user=OTHER_UID, group=OTHER_UID, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def _first_frame(path: str) -> pb.SessionResponse:
    """What a framed socket says to a connection that sends nothing."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        head = s.recv(4, socket.MSG_WAITALL)
        body = s.recv(struct.unpack("<I", head)[0], socket.MSG_WAITALL)
        assert s.recv(1) == b"", "a refused session is closed after its one frame"
    return pb.SessionResponse.FromString(body)


@pytest.mark.process
def test_an_attesting_agent_refuses_a_peer_of_another_pod(attesting: Node) -> None:
    k = attesting.kubelet
    m = open_tenant_memory(str(k.target(POD_A) / "memory.sock"), "alpha")
    assert m.size == 4 * MiB
    m.close()
    # root reaches pod B's socket through the filesystem; the kernel says it is in pod A
    with pytest.raises(NodeMemoryError) as e:
        open_tenant_memory(str(k.target(POD_B) / "memory.sock"), "beta")
    assert e.value.code == "PERMISSION_DENIED"
    assert e.value.message == NOT_IN_POD
    # a process the agent cannot place (no cgroup file for its pid) gets nothing either
    code = f"""
        from kvoffload_connector.common.node_memory import NodeMemoryError, open_tenant_memory
        try:
            open_tenant_memory({str(k.target(POD_A) / "memory.sock")!r}, "alpha")
        except NodeMemoryError as e:
            print(e.code)
    """
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        timeout=30,
    )  # fmt: skip
    assert out.stdout.split() == ["PERMISSION_DENIED"], out.stderr


@pytest.mark.process
def test_pool_and_session_sockets_refuse_a_peer_outside_their_pod(attesting: Node) -> None:
    b_dir, a_dir = attesting.mount(POD_B), attesting.mount(POD_A)
    # pod B's pool.sock: every call answers the refusal, none reaches beta's Pool
    for method in ("Register", "Stats", "Lookup", "Session"):
        assert pool_call(b_dir, method) == (grpc.StatusCode.PERMISSION_DENIED, NOT_IN_POD)
    # pod B's session.sock: one PERMISSION_DENIED frame before anything is read, then closed
    refused = _first_frame(f"{b_dir}/session.sock")
    assert refused.WhichOneof("result") == "error"
    assert (refused.error.code, refused.error.message) == (
        grpc.StatusCode.PERMISSION_DENIED.value[0],
        NOT_IN_POD,
    )
    # a refused pool.sock connection ends on its own, freeing its place
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(f"{b_dir}/pool.sock")
        start = time.monotonic()
        while s.recv(1 << 16):
            pass
        assert time.monotonic() - start < 5
    # a process of another uid in no pod, on pod A's sockets (0666: the filesystem lets it in)
    code = f"""
        import socket, struct, grpc
        from kvoffload.v1 import pool_pb2 as pb, pool_pb2_grpc as pb_grpc
        with grpc.insecure_channel("unix:{a_dir}/pool.sock") as ch:
            try:
                pb_grpc.KVPoolStub(ch).Stats(pb.StatsRequest(), timeout=10)
            except grpc.RpcError as e:
                print(e.code().name)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect("{a_dir}/session.sock")
        size = struct.unpack("<I", s.recv(4, socket.MSG_WAITALL))[0]
        print(pb.SessionResponse.FromString(s.recv(size, socket.MSG_WAITALL)).error.code)
    """
    assert _outside(code) == ["PERMISSION_DENIED", str(grpc.StatusCode.PERMISSION_DENIED.value[0])]
    # the positive control: pod A's own process registers and is served on both sockets
    pod = SlotPod(a_dir, "alpha", "tiny-llama", engine=7)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(f"{a_dir}/{pod.reg.session_socket}")
            attach = pb.AttachRequest(client_id=pod.reg.client_id)
            assert framed_call(s, pb.SessionRequest(seq=1, attach=attach)).HasField("attach")
            lookup = pb.LookupRequest(
                namespace_id=pod.reg.namespace_id, queries=[pb.KeyList(keys=pod.packed([1, 2]))]
            )
            answer = framed_call(s, pb.SessionRequest(seq=2, lookup=lookup))
            assert list(answer.lookup.hit_counts) == [0]
    finally:
        pod.memory.close()
        pod.channel.close()


@pytest.mark.process
def test_a_pods_pool_sock_holds_a_bounded_number_of_connections(attesting: Node) -> None:
    """Past the bound, connections to a pod's pool.sock are closed unanswered; closed ones
    free their places."""
    path = f"{attesting.mount(POD_A)}/pool.sock"
    cap = PoolOptions().max_sessions
    socks = []
    for _ in range(cap + 8):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)  # blocking: waits while the listen backlog is full
        socks.append(s)
    try:
        time.sleep(0.5)  # the agent accepts and closes what is past the bound
        closed = 0
        for s in socks:
            with contextlib.suppress(BlockingIOError):
                closed += s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        assert closed == 8
        with grpc.insecure_channel(f"unix:{path}") as channel, pytest.raises(grpc.RpcError) as e:
            pb_grpc.KVPoolStub(channel).Stats(pb.StatsRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 5
    while pool_call(attesting.mount(POD_A), "Stats")[0] != grpc.StatusCode.OK:
        assert time.monotonic() < deadline, "connections closed by the pod stay counted"
        time.sleep(0.05)


@pytest.mark.process
def test_peers_outside_the_pod_never_take_its_places(attesting: Node) -> None:
    """A process in no pod that holds more connections than the pod may have, on its pool.sock
    and memory.sock: it keeps a few, apart; the pod's own process is served meanwhile."""
    a_dir = attesting.mount(POD_A)
    many = {
        "pool.sock": PoolOptions().max_sessions + 8,
        "memory.sock": MAX_CONNECTIONS_PER_SOCKET + 8,
    }
    code = f"""
        import socket, sys, time
        kinds = {{"pool.sock": socket.SOCK_STREAM, "memory.sock": socket.SOCK_SEQPACKET}}
        held = {{}}
        for name, n in {many!r}.items():
            held[name] = []
            for _ in range(n):
                s = socket.socket(socket.AF_UNIX, kinds[name])
                s.connect("{a_dir}/" + name)
                held[name].append(s)
        time.sleep(0.3)  # the agent accepts, keeps a few and closes the others
        def still_open(s):
            try:
                return s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
            except BlockingIOError:
                return True
        print(*(sum(map(still_open, held[name])) for name in {list(many)!r}), flush=True)
        sys.stdin.read()  # held until the test is done
    """
    outsider = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], user=OTHER_UID, group=OTHER_UID,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert outsider.stdout is not None
        pool_held, memory_held = map(int, outsider.stdout.readline().split())
        assert 0 < pool_held <= MAX_OUTSIDERS_PER_SOCKET
        assert memory_held == MAX_OUTSIDERS_PER_SOCKET
        assert pool_call(a_dir, "Stats")[0] == grpc.StatusCode.OK
        open_tenant_memory(f"{a_dir}/memory.sock", "alpha").close()
    finally:
        outsider.kill()
        outsider.wait(10)
