"""Node-mode test helpers: a real node agent process and a stand-in kubelet driving its CSI
services (bench/node_standin.py, which the serve benchmark's replicas mode shares; fixtures in
conftest.py)."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import grpc
from kvoffload.v1 import pool_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import node_standin as standin  # noqa: E402
from node_standin import AGENT, Kubelet, Pod, make_root, start_holder  # noqa: E402, F401

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


class Agent(standin.Agent):
    """`kvoffload node-agent` as a subprocess, its grants POOL's unless the test writes others."""

    def __init__(self, root: Path, *extra_args: str) -> None:
        super().__init__(root, *extra_args, pool=POOL)

    def command(self) -> list[str]:
        return list(AGENT)  # read at each start: a test may wrap it (a memory cgroup)


POD_A = Pod("team-a", "vllm-a-0", str(uuid.uuid4()), "vllm", "alpha", ALPHA_GROUP)
POD_B = Pod("team-b", "vllm-b-0", str(uuid.uuid4()), "vllm", "beta", BETA_GROUP)


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
