"""The node holder keeps tenants' memfds across agent restarts: a pod's blocks written before
an agent SIGKILL are there for the restarted agent's answers, and the holder serves only the
agent's uid, never a resize."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from kvoffload_connector.common.node_memory import open_tenant_memory
from kvoffload_sidecar.node.holder import Holder, HolderError, lend
from nodeharness import POD_A, POD_B, MiB, Node

pytestmark = pytest.mark.process


def test_a_pods_blocks_outlive_an_agent_sigkill() -> None:
    with Node(POD_A, POD_B) as node:
        k, path = node.kubelet, node.holder_socket
        sock = str(k.target(POD_A) / "memory.sock")
        m = open_tenant_memory(sock, "alpha")
        m.buffer[MiB : MiB + 6] = b"stored"
        m.close()  # the pod lets go: only the holder keeps the memory now
        node.restart_agent()
        again = open_tenant_memory(sock, "alpha")
        assert again.buffer[MiB : MiB + 6] == b"stored"
        again.close()
        # a resize of a held tenant is refused (its size is sealed)
        with pytest.raises(HolderError) as e:
            lend(path, "alpha", 8 * MiB)
        assert e.value.code == "FAILED_PRECONDITION"
        # another uid cannot reach the holder's socket (0600 in a 0700 directory)
        code = f"""
            import socket
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                s.connect({path!r})
            except PermissionError:
                print("EACCES")
        """
        out = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)], user=4242, group=4242,
            extra_groups=[], capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert out.stdout.split() == ["EACCES"], out.stderr
        k.unpublish(POD_A)
        k.unpublish(POD_B)


def test_the_holder_answers_only_its_own_uid_and_takes_no_fds() -> None:
    h = Holder()
    req = json.dumps({"v": 1, "op": "lend", "tenant": "t", "size": 2 * MiB}).encode()
    answer, fd = h.handle(req, [], peer_uid=os.getuid() + 1)
    assert (answer["code"], fd) == ("PERMISSION_DENIED", None)
    r, w = os.pipe()
    answer, fd = h.handle(req, [w], peer_uid=os.getuid())
    assert (answer["code"], fd) == ("INVALID_ARGUMENT", None)
    os.set_blocking(r, False)
    assert os.read(r, 1) == b""  # the sent fd was closed, not kept
    os.close(r)
    for bad in (b"{}", b"[1]", b"\xff", json.dumps({"v": 1, "op": "lend", "tenant": "t"}).encode()):
        assert h.handle(bad, [], peer_uid=os.getuid())[0]["code"] == "INVALID_ARGUMENT"
    answer, fd = h.handle(req, [], peer_uid=os.getuid())
    assert answer["code"] == "OK" and os.fstat(fd).st_size == 2 * MiB
    os.close(fd)
