"""A node as node mode runs on it, without Kubernetes: `kvoffload node-holder` and `kvoffload
node-agent` as child processes, and a stand-in kubelet that drives the agent's CSI Node service
for a pod's inline volume as the kubelet does (NodePublishVolume with the pod's identity under
`<root>/kubelet/pods/<uid>/...`). The node tests (tests/node/nodeharness.py) and the serve
benchmark's `replicas` mode both use it; nothing here is shipped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from kvoffload.csi.v1 import csi_pb2, csi_pb2_grpc

# the console script, as the DaemonSet runs it; the node tests replace [0] where it is not
# installed beside the interpreter (read at each start, so the replacement counts)
AGENT = [str(Path(sys.executable).parent / "kvoffload"), "node-agent"]


def kvoffload_script() -> str:
    """`kvoffload` beside this interpreter, else a shim of it on this interpreter (the GPU
    machine runs the checkout from PYTHONPATH and has no console script)."""
    if Path(AGENT[0]).exists():
        return AGENT[0]
    shim = Path(tempfile.mkdtemp(prefix="kvo-bin-")) / "kvoffload"
    shim.write_text(
        f"#!{sys.executable}\nimport sys\nfrom kvoffload_cli.main import main\nsys.exit(main())\n"
    )
    shim.chmod(0o755)
    AGENT[0] = str(shim)  # once per process
    return AGENT[0]


@dataclass(frozen=True)
class Pod:
    namespace: str
    name: str
    uid: str
    service_account: str
    tenant: str
    group: int | None

    def context(self, **override: str) -> dict[str, str]:
        """The volume context a kubelet sends for this pod's inline volume (podInfoOnMount)."""
        ctx = {
            "csi.storage.k8s.io/ephemeral": "true",
            "csi.storage.k8s.io/pod.namespace": self.namespace,
            "csi.storage.k8s.io/pod.name": self.name,
            "csi.storage.k8s.io/pod.uid": self.uid,
            "csi.storage.k8s.io/serviceAccount.name": self.service_account,
            "tenant": self.tenant,
        }
        ctx.update(override)
        return {k: v for k, v in ctx.items() if v is not None}


def new_pod(namespace: str, name: str, tenant: str, group: int | None = None) -> Pod:
    """A pod of service account `vllm` with a fresh uid."""
    return Pod(namespace, name, str(uuid.uuid4()), "vllm", tenant, group)


class Kubelet:
    """Calls the agent's CSI socket the way the kubelet does for an inline ephemeral volume."""

    def __init__(self, root: Path, csi_socket: Path) -> None:
        self.pods_dir = root / "kubelet" / "pods"
        self.channel = grpc.insecure_channel(f"unix://{csi_socket}")
        self.identity = csi_pb2_grpc.IdentityStub(self.channel)
        self.node = csi_pb2_grpc.NodeStub(self.channel)

    def target(self, pod: Pod) -> Path:
        # /var/lib/kubelet/pods/<uid>/volumes/kubernetes.io~csi/<volume>/mount: longer than a
        # sun_path can hold, as on a real node
        return self.pods_dir / pod.uid / "volumes" / "kubernetes.io~csi" / "kvoffload" / "mount"

    @staticmethod
    def volume_id(pod: Pod) -> str:
        return f"csi-{uuid.uuid5(uuid.NAMESPACE_URL, pod.uid).hex}"

    def publish(
        self,
        pod: Pod,
        *,
        context: dict[str, str] | None = None,
        block: bool = False,
        target: Path | None = None,
    ):
        target = target or self.target(pod)
        target.parent.mkdir(parents=True, exist_ok=True)  # the kubelet makes the parent
        cap = csi_pb2.VolumeCapability(
            access_mode=csi_pb2.VolumeCapability.AccessMode(
                mode=csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_WRITER
            )
        )
        if block:
            cap.block.SetInParent()
        else:
            cap.mount.SetInParent()
            if pod.group is not None:
                cap.mount.volume_mount_group = str(pod.group)
        return self.node.NodePublishVolume(
            csi_pb2.NodePublishVolumeRequest(
                volume_id=self.volume_id(pod),
                target_path=str(target),
                volume_capability=cap,
                readonly=False,
                volume_context=pod.context() if context is None else context,
            ),
            timeout=10,
            wait_for_ready=True,  # the kubelet retries while the plugin restarts
        )

    def short(self, pod: Pod) -> str:
        """The pod's volume as the pod sees it: a short path to its directory (a real pod
        mounts it at /var/run/kvoffload; the published path is longer than sun_path)."""
        link = self.pods_dir.parent.parent / f"m-{pod.uid}"
        if not link.is_symlink():
            link.symlink_to(self.target(pod))
        return str(link)

    def unpublish(self, pod: Pod):
        return self.node.NodeUnpublishVolume(
            csi_pb2.NodeUnpublishVolumeRequest(
                volume_id=self.volume_id(pod), target_path=str(self.target(pod))
            ),
            timeout=10,
            wait_for_ready=True,
        )


class Agent:
    """`kvoffload node-agent` as a subprocess, restartable on the same state; its grants from
    a fixed node pool file (`pool`: the KVOffloadNodePool's `{name, tenants}`)."""

    def __init__(self, root: Path, *extra_args: str, pool: dict[str, Any] | None = None) -> None:
        self.root = root
        self.extra_args = extra_args
        self.pool_args: list[str] = []  # how the agent gets its grants; default: the file
        self.csi_socket = root / "csi.sock"
        self.pool_file = root / "node-pool.json"
        if pool is not None:
            self.pool_file.write_text(json.dumps(pool))
        self.log = root / "agent.log"
        self.proc: subprocess.Popen[str] | None = None

    def command(self) -> list[str]:
        """`kvoffload node-agent` (a caller may run it under a wrapper)."""
        return [kvoffload_script(), *AGENT[1:]]

    def start(self, timeout_s: float = 20.0) -> None:
        self.csi_socket.unlink(missing_ok=True)
        log = self.log.open("w")
        self.proc = subprocess.Popen(
            [
                *self.command(),
                "--csi-socket",
                str(self.csi_socket),
                "--node-id",
                "node-a",
                *(self.pool_args or ["--node-pool", str(self.pool_file)]),
                "--state-dir",
                str(self.root / "state"),
                "--publish-root",
                str(self.root / "kubelet" / "pods"),
                *self.extra_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        log.close()
        # the agent prints its serving line once gRPC listens (the socket file exists earlier)
        deadline = time.monotonic() + timeout_s
        while "node agent serving" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"the node agent did not start: {self.log.read_text()}")
            time.sleep(0.02)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_holder(root: Path, timeout_s: float = 20.0) -> tuple[subprocess.Popen, str]:
    """`kvoffload node-holder` with its socket in a 0700 directory, as the chart runs it."""
    d = root / "holder"
    d.mkdir(mode=0o700)
    path = str(d / "holder.sock")
    log = root / "holder.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [kvoffload_script(), "node-holder", "--socket", path, "--prefault"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while "node holder serving" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the node holder did not start: {log.read_text()}")
        time.sleep(0.02)
    return proc, path


def make_root() -> Path:
    # traversable by other uids (pytest's tmp_path is 0700), so permission checks are the
    # socket's and its directory's own
    root = Path(tempfile.mkdtemp(prefix="kvo-node-", dir="/tmp"))
    os.chmod(root, 0o755)
    return root
