"""Peer attestation: the agent places a connecting process in its pod by the kernel's cgroup
path and refuses a process of another pod even where the filesystem let it reach the socket."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kvoffload_connector.common.node_memory import NodeMemoryError, open_tenant_memory
from kvoffload_sidecar.node.attest import pod_uid_of_cgroup
from nodeharness import POD_A, POD_B, MiB, Node

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


@pytest.mark.process
def test_an_attesting_agent_refuses_a_peer_of_another_pod(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    # this test process is "in" pod A for the agent: its cgroup file, systemd driver
    (proc / str(os.getpid())).mkdir(parents=True)
    (proc / str(os.getpid()) / "cgroup").write_text(
        "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod"
        f"{POD_A.uid.replace('-', '_')}.slice/cri-containerd-1.scope\n"
    )
    attesting = ("--attest-peers", "cgroup", "--proc-root", str(proc))
    with Node(POD_A, POD_B, holder=False, agent_args=attesting) as node:
        k = node.kubelet
        m = open_tenant_memory(str(k.target(POD_A) / "memory.sock"), "alpha")
        assert m.size == 4 * MiB
        m.close()
        # root reaches pod B's socket through the filesystem; the kernel says it is in pod A
        with pytest.raises(NodeMemoryError) as e:
            open_tenant_memory(str(k.target(POD_B) / "memory.sock"), "beta")
        assert e.value.code == "PERMISSION_DENIED"
        assert "not in this socket's pod" in e.value.message
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
        k.unpublish(POD_A)
        k.unpublish(POD_B)
