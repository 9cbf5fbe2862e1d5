"""Node-mode test helpers: a real node agent process and a stand-in kubelet driving its CSI
services (bench/node_standin.py, which the serve benchmark's replicas mode shares; fixtures in
conftest.py)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from kvoffload.v1 import pool_pb2 as pb
from kvoffload.v1 import pool_pb2_grpc as pb_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import node_standin as standin  # noqa: E402
from node_standin import AGENT, Kubelet, Pod, make_root, start_holder  # noqa: E402, F401

MiB = 1 << 20
CLIENT = str(Path(__file__).with_name("slot_client.py"))  # a pod's client process
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


class Agent(standin.Agent):
    """`kvoffload node-agent` as a subprocess, its grants POOL's unless the test writes others."""

    def __init__(self, root: Path, *extra_args: str) -> None:
        super().__init__(root, *extra_args, pool=POOL)

    def command(self) -> list[str]:
        return list(AGENT)  # read at each start: a test may wrap it (a memory cgroup)


POD_A = Pod("team-a", "vllm-a-0", str(uuid.uuid4()), "vllm", "alpha", ALPHA_GROUP)
POD_B = Pod("team-b", "vllm-b-0", str(uuid.uuid4()), "vllm", "beta", BETA_GROUP)


POD_A2 = Pod("team-a", "vllm-a-1", str(uuid.uuid4()), "vllm", "alpha", ALPHA_GROUP)  # A's replica


class Node:
    """A node for a test: the holder (unless `holder=False`), the agent beside it (its memfds
    from the holder; its grants POOL's unless `pool`), the kubelet stand-in, `pods` published.
    A context manager; `mount(pod)`: the pod's volume as the pod sees it."""

    def __init__(
        self,
        *pods: Pod,
        holder: bool = True,
        pool: dict[str, Any] | None = None,
        agent_args: Sequence[str] = (),
    ) -> None:
        self.root = make_root()
        self.holder: subprocess.Popen | None = None
        self.holder_socket = ""
        try:
            if holder:
                self.holder, self.holder_socket = start_holder(self.root)
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise
        held = ["--holder-socket", self.holder_socket] if holder else []
        self.agent = Agent(self.root, *held, *agent_args)
        if pool is not None:
            self.agent.pool_file.write_text(json.dumps(pool))
        self.kubelet = Kubelet(self.root, self.agent.csi_socket)
        try:
            self.agent.start()
            for pod in pods:
                self.kubelet.publish(pod)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Node:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def mount(self, pod: Pod) -> str:
        """The pod's volume as the pod sees it (a short link; a pod mounts it at
        /var/run/kvoffload, and the published path is longer than sun_path)."""
        return self.kubelet.short(pod)

    def client(self, pod: Pod, action: str, *args: str) -> dict:
        """tests/node/slot_client.py as a process of the pod's own over its sockets: its
        report."""
        out = subprocess.run(
            [sys.executable, CLIENT, self.mount(pod), action, "--tenant", pod.tenant, *args],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, f"{out.stderr}\n--- agent ---\n{self.agent.log.read_text()}"
        return json.loads(out.stdout.splitlines()[-1])

    def stats(self, pod: Pod) -> pb.StatsResponse:
        with grpc.insecure_channel(f"unix:{self.mount(pod)}/pool.sock") as channel:
            return pb_grpc.KVPoolStub(channel).Stats(
                pb.StatsRequest(), timeout=10, wait_for_ready=True
            )

    def restart_agent(self) -> None:
        """The agent SIGKILLed and started again beside the same holder."""
        self.agent.kill()
        self.agent.start()

    def replace(self) -> None:
        """Holder and agent SIGKILLed; a new holder (new memfds: new pools), the agent again."""
        assert self.holder is not None
        self.agent.kill()
        self.holder.send_signal(signal.SIGKILL)
        self.holder.wait(10)
        shutil.rmtree(self.root / "holder")
        self.holder, path = start_holder(self.root)
        assert path == self.holder_socket
        self.agent.start()

    def close(self) -> None:
        self.kubelet.channel.close()
        self.agent.stop()
        if self.holder is not None and self.holder.poll() is None:
            self.holder.send_signal(signal.SIGTERM)
            self.holder.wait(10)
        shutil.rmtree(self.root, ignore_errors=True)


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
