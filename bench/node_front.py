"""What a pod's `pool.sock` front (the agent's accept loop that attests each peer and splices it
to the pod's gRPC server) adds to the control RPCs, against the same server reached directly.

A real `kvoffload node-agent` with `--attest-peers cgroup` (this process placed in the pod by a
stand-in proc root), one published pod, and one client process doing, in turns, the same calls
on `pool.sock` (through the front) and on the pod server's private abstract address (found in
`/proc/net/unix`, which only a process of the agent's network namespace reaches): `Stats` and
`Register` on an open channel, and a new channel's first `Stats` (connect, attestation, splice).

    python -m bench node_front --calls 500
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path

import grpc
from kvoffload.v1 import pool_pb2 as pb
from kvoffload.v1 import pool_pb2_grpc as pb_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from node_standin import Agent, Kubelet, Pod, make_root  # noqa: E402

MiB = 1 << 20
POOL = {"name": "bench", "tenants": [{"name": "t", "shareBytes": 8 * MiB, "namespaces": ["ns"]}]}
SPEC = pb.NamespaceSpec(
    model="bench-model",
    dtype="bfloat16",
    kv_layout="LBHNC/packed-kv",
    block_size=16,
    chunk_blocks=1,
    tp_size=1,
    hash_algo="sha256",
    key_size=32,
)


def private_targets(agent_pid: int) -> list[str]:
    """The agent's abstract gRPC addresses (its pod servers; no outsider server here)."""
    prefix = f"@kvoffload-node-{agent_pid}-"
    names = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) == 8 and fields[7].startswith(prefix):
            names.add(fields[7][1:])
    return [f"unix-abstract:{n}" for n in sorted(names)]


def summary(us: list[float]) -> dict[str, float]:
    us = sorted(us)
    return {
        "p50_us": round(statistics.median(us), 1),
        "p90_us": round(us[int(0.9 * (len(us) - 1))], 1),
        "p99_us": round(us[int(0.99 * (len(us) - 1))], 1),
    }


def paired(calls: dict[str, object], rounds: int) -> dict[str, dict[str, float]]:
    """Each of `calls` (name -> a call) once per round, in turns, the order alternating, so a
    busy machine's noise falls on both alike."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for i in range(rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            calls[name]()
            times[name].append((time.perf_counter() - t0) * 1e6)
    return {name: summary(us) for name, us in times.items()}


def measure(targets: dict[str, str], calls: int) -> dict[str, dict[str, dict[str, float]]]:
    """Per call kind, per target (front, direct): its latency."""
    register = pb.RegisterRequest(spec=SPEC, num_ranks=1, slot_bytes_per_rank=64 << 10)
    channels = {name: grpc.insecure_channel(t) for name, t in targets.items()}
    stubs = {name: pb_grpc.KVPoolStub(ch) for name, ch in channels.items()}
    try:
        for stub in stubs.values():
            stub.Stats(pb.StatsRequest(), timeout=10, wait_for_ready=True)
        out = {
            "Stats": paired(
                {n: (lambda s=s: s.Stats(pb.StatsRequest(), timeout=10)) for n, s in stubs.items()},
                calls,
            ),
            "Register": paired(
                {n: (lambda s=s: s.Register(register, timeout=10)) for n, s in stubs.items()},
                calls // 5,
            ),
        }
    finally:
        for ch in channels.values():
            ch.close()

    def first_call(target: str) -> None:
        with grpc.insecure_channel(target) as fresh:
            pb_grpc.KVPoolStub(fresh).Stats(pb.StatsRequest(), timeout=10, wait_for_ready=True)

    out["new channel"] = paired(
        {n: (lambda t=t: first_call(t)) for n, t in targets.items()}, calls // 10
    )
    return out


def pod_server(candidates: list[str]) -> str:
    """Of the agent's private addresses, the pod's server (the outsider server refuses)."""
    for target in candidates:
        with grpc.insecure_channel(target) as ch:
            try:
                pb_grpc.KVPoolStub(ch).Stats(pb.StatsRequest(), timeout=10, wait_for_ready=True)
                return target
            except grpc.RpcError:
                continue
    raise AssertionError(f"no pod server among {candidates}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--out", type=Path, default=Path("bench/out/node_front.json"))
    ns = p.parse_args()
    root = make_root()
    pod = Pod("ns", "bench-0", str(uuid.uuid4()), "vllm", "t", None)
    proc = root / "proc" / str(os.getpid())
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(f"0::/kubepods/besteffort/pod{pod.uid}/c\n")
    agent = Agent(
        root,
        "--attest-peers", "cgroup", "--proc-root", str(root / "proc"), "--client-timeout-s", "600",
        pool=POOL,
    )  # fmt: skip
    agent.start()
    kubelet = Kubelet(root, agent.csi_socket)
    try:
        kubelet.publish(pod)
        assert agent.proc is not None
        candidates = private_targets(agent.proc.pid)
        assert len(candidates) == 2, candidates  # the pod's server and the outsider server
        targets = {
            "front": f"unix:{kubelet.short(pod)}/pool.sock",
            "direct": pod_server(candidates),
        }
        rows = measure(targets, ns.calls)
    finally:
        kubelet.channel.close()
        agent.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(f"{'call':<12} {'direct p50':>11} {'front p50':>10} {'added':>8} {'front p99':>10}")
    for call, row in rows.items():
        d, f = row["direct"], row["front"]
        added = f["p50_us"] - d["p50_us"]
        print(f"{call:<12} {d['p50_us']:>9.0f}us {f['p50_us']:>8.0f}us {added:>6.0f}us "
              f"{f['p99_us']:>8.0f}us")  # fmt: skip
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps({"calls": ns.calls, **rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
