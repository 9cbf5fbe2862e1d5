"""Node-mode test helpers: a real node agent process and a stand-in kubelet driving its CSI
services (fixtures in conftest.py)."""

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

import grpc
from kvoffload.csi.v1 import csi_pb2, csi_pb2_grpc
from kvoffload.v1 import pool_pb2 as pb

MiB = 1 << 20
ALPHA_GROUP = None  # pod A sets no fsGroup: its socket is 0666 in a 0755 directory
BETA_GROUP = 2002  # pod B's fsGroup: its directory and socket belong to that group only
POOL = {
    "name": "node-pool",
    "tenants": [
        {"name": "alpha", "shareBytes": 4 * MiB, "namespaces": ["team-a"]},
        {
            "name": "beta",
            "shareBytes": 2 * MiB,
            "namespaces": ["team-b"],
            "serviceAccounts": ["vllm"],
        },
    ],
}


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
    """`kvoffload node-agent` as a subprocess, restartable on the same state."""

    def __init__(self, root: Path, *extra_args: str) -> None:
        self.root = root
        self.extra_args = extra_args
        self.pool_args: list[str] = []  # how the agent gets its grants; default: the file
        self.csi_socket = root / "csi.sock"
        self.pool_file = root / "node-pool.json"
        self.pool_file.write_text(json.dumps(POOL))
        self.log = root / "agent.log"
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        self.csi_socket.unlink(missing_ok=True)
        log = self.log.open("w")
        self.proc = subprocess.Popen(
            [
                *AGENT,
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
        deadline = time.monotonic() + 20
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


# the console script, as the DaemonSet runs it
AGENT = [str(Path(sys.executable).parent / "kvoffload"), "node-agent"]

POD_A = Pod("team-a", "vllm-a-0", str(uuid.uuid4()), "vllm", "alpha", ALPHA_GROUP)
POD_B = Pod("team-b", "vllm-b-0", str(uuid.uuid4()), "vllm", "beta", BETA_GROUP)


def make_root() -> Path:
    # traversable by other uids (pytest's tmp_path is 0700), so permission checks are the
    # socket's and its directory's own
    root = Path(tempfile.mkdtemp(prefix="kvo-node-", dir="/tmp"))
    os.chmod(root, 0o755)
    return root


def pool_call(directory: str, method: str = "Register") -> tuple[grpc.StatusCode, str]:
    """One KVPool call on the `pool.sock` in `directory`, with an empty request: (code,
    details). A refusing server answers its refusal; a pod's real server answers (Stats: OK,
    Register: INVALID_ARGUMENT for the empty spec), so a refusal here proves no Pool was asked."""
    name = f"/kvoffload.v1.KVPool/{method}"
    with grpc.insecure_channel(f"unix:{directory}/pool.sock") as channel:
        try:
            if method == "Session":
                call = channel.stream_stream(
                    name,
                    request_serializer=pb.SessionRequest.SerializeToString,
                    response_deserializer=pb.SessionResponse.FromString,
                )
                list(call(iter([pb.SessionRequest(seq=1)]), timeout=10, wait_for_ready=True))
            else:
                request = getattr(pb, f"{method}Request")
                response = getattr(pb, f"{method}Response")
                call = channel.unary_unary(
                    name,
                    request_serializer=request.SerializeToString,
                    response_deserializer=response.FromString,
                )
                call(request(), timeout=10, wait_for_ready=True)
        except grpc.RpcError as e:
            return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


KVPOOL_METHODS = [m.name for m in pb.DESCRIPTOR.services_by_name["KVPool"].methods]
