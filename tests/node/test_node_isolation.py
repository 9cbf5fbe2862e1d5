"""A pod of one tenant tries everything it can against the node agent and gets nothing of
another tenant's memory: each attempt is refused with a precise code or errno."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import struct
import subprocess
import sys
import textwrap
import time
import uuid

import grpc
import pytest
from kvoffload.v1 import pool_pb2 as pb
from kvoffload.v1 import pool_pb2_grpc as pb_grpc
from kvoffload_connector.common import node_memory
from kvoffload_connector.common.node_memory import (
    NodeMemoryError,
    connect,
    open_tenant_memory,
    request,
)
from kvoffload_sidecar.node import tenant_memory
from nodeharness import KVPOOL_METHODS, POD_A, POD_B, MiB, Pod, pool_call
from slot_client import SLOT_BYTES
from slot_client import spec as namespace_spec

pytestmark = pytest.mark.process

OTHER_UID = 4242  # a process of another pod: neither root nor in pod B's fsGroup


def _sock(k, pod) -> str:
    return str(k.target(pod) / "memory.sock")


def _refused(path: str, doc: object, fds: list[int] | None = None) -> dict:
    with connect(path, 5) as s:
        answer, got = request(s, doc, fds)
    assert got == [], "a refusal carries no fd"
    return answer


def test_client_and_agent_speak_one_protocol() -> None:
    assert node_memory.PROTOCOL_VERSION == tenant_memory.PROTOCOL_VERSION
    assert node_memory.REQUIRED_SEALS & tenant_memory.SEALS == node_memory.REQUIRED_SEALS


def test_a_pod_never_gets_another_tenants_memory(published) -> None:
    _, k = published
    for tenant in ("beta", "gamma", "alpha "):
        with pytest.raises(NodeMemoryError) as e:
            open_tenant_memory(_sock(k, POD_A), tenant)
        assert e.value.code == "PERMISSION_DENIED"
    # an unknown tenant and another's read the same: no oracle for tenant names
    with pytest.raises(NodeMemoryError) as known:
        open_tenant_memory(_sock(k, POD_A), "beta")
    with pytest.raises(NodeMemoryError) as unknown:
        open_tenant_memory(_sock(k, POD_A), "gamma")
    assert known.value.message.replace("beta", "T") == unknown.value.message.replace("gamma", "T")


def test_forged_identity_fields_are_refused(published) -> None:
    _, k = published
    forged = [
        {"v": 1, "op": "open", "tenant": "beta", "namespace": "team-b"},
        {"v": 1, "op": "open", "tenant": "beta", "pod_uid": POD_B.uid},
        {"v": 1, "op": "open", "tenant": "beta", "service_account": "vllm", "pod": POD_B.name},
    ]
    for doc in forged:
        answer = _refused(_sock(k, POD_A), doc)
        assert answer["code"] == "INVALID_ARGUMENT", answer
        assert "identity comes from its socket" in answer["message"]
    for doc in (
        [1, 2],
        "open beta",
        {"v": 2, "op": "open", "tenant": "alpha"},
        {"v": 1, "op": "dump", "tenant": "alpha"},
        {"v": 1, "op": "open", "tenant": 7},
    ):
        assert _refused(_sock(k, POD_A), doc)["code"] == "INVALID_ARGUMENT"
    with connect(_sock(k, POD_A), 5) as s:  # not JSON, and too long
        for raw in (b"\xff\xfe", b"{" * (tenant_memory.MAX_REQUEST + 1)):
            s.send(raw)
            assert json.loads(s.recv(4096))["code"] == "INVALID_ARGUMENT"
        # the connection still serves its own tenant after every refusal
        answer, fds = request(s, {"v": 1, "op": "open", "tenant": "alpha"})
        assert answer["code"] == "OK" and len(fds) == 1
        os.close(fds[0])


def test_fds_a_pod_sends_are_refused_and_closed_unused(published) -> None:
    _, k = published
    r, w = os.pipe()
    own = os.memfd_create("forged-beta", os.MFD_ALLOW_SEALING)
    os.ftruncate(own, 2 * MiB)
    answer = _refused(_sock(k, POD_A), {"v": 1, "op": "open", "tenant": "alpha"}, [w, own])
    assert answer["code"] == "INVALID_ARGUMENT" and "file descriptors" in answer["message"]
    os.close(w)
    os.close(own)
    # the agent kept no copy of the pipe's write end: the read end sees EOF at once
    os.set_blocking(r, False)
    assert os.read(r, 1) == b""
    os.close(r)


def test_seals_refuse_every_resize_with_eperm(published) -> None:
    _, k = published
    m = open_tenant_memory(_sock(k, POD_A), "alpha")
    try:
        seals = fcntl.fcntl(m.fd, fcntl.F_GET_SEALS)
        assert seals == fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
        attempts = {
            "grow": lambda: os.ftruncate(m.fd, 2 * m.size),
            "shrink": lambda: os.ftruncate(m.fd, m.size // 2),
            "truncate to 0": lambda: os.ftruncate(m.fd, 0),
            "fallocate past the end": lambda: os.posix_fallocate(m.fd, m.size, MiB),
            "write past the end": lambda: os.pwrite(m.fd, b"x", m.size),
            # F_SEAL_SEAL: no seal can be added either (a write seal would stop every writer)
            "add a write seal": lambda: fcntl.fcntl(m.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE),
        }
        for what, attempt in attempts.items():
            with pytest.raises(OSError) as e:
                attempt()
            assert e.value.errno == errno.EPERM, what
        assert os.fstat(m.fd).st_size == 4 * MiB
    finally:
        m.close()


def _as_other_pod(code: str, extra_groups: list[int]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        user=OTHER_UID,
        group=OTHER_UID,
        extra_groups=extra_groups,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_another_pods_socket_is_out_of_reach_or_bound_to_that_pod(published) -> None:
    a, k = published
    assert os.getuid() == 0, "this test runs its attacker as another uid: run it as root"
    probe = f"""
        import errno
        from kvoffload_connector.common.node_memory import NodeMemoryError, open_tenant_memory
        try:
            m = open_tenant_memory({_sock(k, POD_B)!r}, "beta")
        except PermissionError as e:
            print("EACCES" if e.errno == errno.EACCES else e.errno)
        except NodeMemoryError as e:
            print(e.code)
        else:
            print("OK", m.size)
    """
    # pod B's socket belongs to its fsGroup: another pod's uid cannot even connect
    assert _as_other_pod(probe, []).stdout.split() == ["EACCES"]
    # the same uid inside pod B (its fsGroup) connects and gets beta: the positive control
    assert _as_other_pod(probe, [POD_B.group]).stdout.split() == ["OK", str(2 * MiB)]
    # whoever reaches a socket speaks as the pod it is bound to, never as itself
    with pytest.raises(NodeMemoryError) as e:
        open_tenant_memory(_sock(k, POD_B), "alpha")
    assert e.value.code == "PERMISSION_DENIED"
    # pod A's socket (no fsGroup) is open to its own pod's uids, and serves only alpha
    own = probe.replace(_sock(k, POD_B), _sock(k, POD_A)).replace('"beta"', '"alpha"')
    assert _as_other_pod(own, []).stdout.split() == ["OK", str(4 * MiB)]


def test_the_agents_memfds_are_not_reachable_through_proc(published) -> None:
    a, _ = published
    fd_dir = f"/proc/{a.proc.pid}/fd"
    links = {n: os.readlink(f"{fd_dir}/{n}") for n in os.listdir(fd_dir)}
    memfds = [n for n, link in links.items() if "memfd:kvoffload-tenant-" in link]
    # each tenant's memfd, held by its memory and by its pool's mapping (several fds)
    assert {links[n].split()[0] for n in memfds} == {
        "/memfd:kvoffload-tenant-alpha",
        "/memfd:kvoffload-tenant-beta",
    }
    code = f"""
        import errno
        for n in {memfds!r}:
            try:
                open("{fd_dir}/" + n, "r+b")
            except PermissionError as e:
                print("EACCES" if e.errno == errno.EACCES else e.errno)
            else:
                print("OPENED")
    """
    assert _as_other_pod(code, [POD_B.group]).stdout.split() == ["EACCES"] * len(memfds)


def test_connections_per_socket_are_bounded(published) -> None:
    """A pod cannot exhaust the agent's fds: past the bound, connections close unanswered."""
    _, k = published
    cap = tenant_memory.MAX_CONNECTIONS_PER_SOCKET
    socks = []
    for _ in range(2 * cap):
        with contextlib.suppress(BlockingIOError):  # a full listen backlog bounds it too
            socks.append(connect(_sock(k, POD_A), 5))
    answered = 0
    try:
        for s in socks:
            try:
                s.send(json.dumps({"v": 1, "op": "open", "tenant": "alpha"}).encode())
                data, fds, _, _ = socket.recv_fds(s, 4096, 2)
            except (ConnectionResetError, BrokenPipeError):
                continue
            for fd in fds:
                os.close(fd)
            answered += bool(data)
    finally:
        for s in socks:
            s.close()
    assert 0 < answered <= cap
    deadline = time.monotonic() + 5  # closed ones free their places once the agent reads EOF
    while True:
        try:
            open_tenant_memory(_sock(k, POD_A), "alpha").close()
            break
        except NodeMemoryError:
            assert time.monotonic() < deadline, "connections closed by the pod stay counted"
            time.sleep(0.05)


def test_each_answer_is_its_own_open_file_description(published) -> None:
    """OFD locks (engine locks) of one holder must conflict with another's, never be shared."""
    _, k = published
    m1 = open_tenant_memory(_sock(k, POD_A), "alpha")
    m2 = open_tenant_memory(_sock(k, POD_A), "alpha")
    try:
        assert os.fstat(m1.fd).st_ino == os.fstat(m2.fd).st_ino  # one memfd
        lock = struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, 1 << 40, 1, 0) + b"\0" * 4
        fcntl.fcntl(m1.fd, fcntl.F_OFD_SETLK, lock)
        with pytest.raises(OSError) as e:  # another description: the lock conflicts
            fcntl.fcntl(m2.fd, fcntl.F_OFD_SETLK, lock)
        assert e.value.errno in (errno.EAGAIN, errno.EACCES)
    finally:
        m1.close()
        m2.close()


def _alpha_stats(k) -> pb.StatsResponse:
    with grpc.insecure_channel(f"unix:{k.short(POD_A)}/pool.sock") as channel:
        return pb_grpc.KVPoolStub(channel).Stats(pb.StatsRequest(), timeout=10)


def test_a_pod_without_a_grant_gets_no_memfd_and_reaches_no_pool(published) -> None:
    """A pod whose namespace holds no grant is published (the kubelet starts it), and whatever
    it asks of its own sockets, it receives no tenant's memfd and no call of it reaches a Pool:
    neither the tenant it names (alpha, team-a's) nor any other."""
    _, k = published
    intruder = Pod("team-c", "vllm-c-0", str(uuid.uuid4()), "vllm", "alpha", None)
    k.publish(intruder)
    before = _alpha_stats(k)
    try:
        sock = _sock(k, intruder)
        for tenant in ("alpha", "beta", "gamma"):
            answer = _refused(sock, {"v": 1, "op": "open", "tenant": tenant})
            assert answer["code"] == "PERMISSION_DENIED", answer
        # naming the identity of a granted pod changes nothing either
        forged = {"v": 1, "op": "open", "tenant": "alpha", "namespace": "team-a"}
        assert _refused(sock, forged)["code"] == "INVALID_ARGUMENT"
        directory = k.short(intruder)
        for method in KVPOOL_METHODS:  # a real server would answer Stats OK
            code, details = pool_call(directory, method)
            assert code == grpc.StatusCode.PERMISSION_DENIED, (method, code, details)
            assert "'alpha' is not granted to namespace team-c" in details
        register = pb.RegisterRequest(  # a well-formed one, as a connector's
            spec=namespace_spec("tiny-llama"),
            num_ranks=1,
            slot_bytes_per_rank=SLOT_BYTES,
            client_name="intruder/rank-0",
            engine=7,
        )
        channel = grpc.insecure_channel(f"unix:{directory}/pool.sock")
        with channel, pytest.raises(grpc.RpcError) as e:
            pb_grpc.KVPoolStub(channel).Register(register, timeout=10)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert not (k.target(intruder) / "session.sock").exists()
        after = _alpha_stats(k)
        assert len(after.namespaces) == len(before.namespaces)  # no namespace registered
        assert after.pool_generation == before.pool_generation
    finally:
        k.unpublish(intruder)
    assert not k.target(intruder).exists()
