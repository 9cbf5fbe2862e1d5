"""The node holder keeps tenants' memfds across agent restarts: a pod's blocks written before
an agent SIGKILL are there for the restarted agent's answers, and the holder serves only the
agent's uid, never a resize."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from kvoffload_connector.common.node_memory import open_tenant_memory
from kvoffload_sidecar.node.holder import Holder, HolderError, lend
from nodeharness import AGENT, POD_A, POD_B, Agent, Kubelet, MiB, make_root

pytestmark = pytest.mark.process


def _start_holder(root: Path) -> tuple[subprocess.Popen, str]:
    d = root / "holder"
    d.mkdir(mode=0o700)
    path = str(d / "holder.sock")
    log = root / "holder.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [AGENT[0], "node-holder", "--socket", path, "--prefault"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    deadline = time.monotonic() + 20
    while "node holder serving" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.02)
    return proc, path


def test_a_pods_blocks_outlive_an_agent_sigkill() -> None:
    root = make_root()
    holder, path = _start_holder(root)
    a = Agent(root, "--holder-socket", path)
    a.start()
    k = Kubelet(root, a.csi_socket)
    try:
        k.publish(POD_A)
        k.publish(POD_B)
        sock = str(k.target(POD_A) / "memory.sock")
        m = open_tenant_memory(sock, "alpha")
        m.buffer[MiB : MiB + 6] = b"stored"
        m.close()  # the pod lets go: only the holder keeps the memory now
        a.kill()
        a.start()
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
    finally:
        k.channel.close()
        a.stop()
        holder.terminate()
        holder.wait(10)
        shutil.rmtree(root, ignore_errors=True)


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
