"""`kvoffload node-agent`: the node agent (CSI services + tenant memory).

The grants come from the `KVOffloadNodePool` named by `--node-pool-name`, followed through the
API (follow.py: it also checks the CSIDriver and writes this node's status), or from a fixed
`--node-pool FILE` with the same fields. Each tenant's memfd gets its pool (pools.py): every
published pod's `pool.sock` and `session.sock` serve the slot protocol on its tenant's pool.
"""

from __future__ import annotations

import argparse
import functools
import logging
import signal
import threading
from collections.abc import Sequence
from pathlib import Path

from kvoffload_sidecar.node import holder
from kvoffload_sidecar.node.access import Access
from kvoffload_sidecar.node.attest import CgroupAttestor
from kvoffload_sidecar.node.csi import NodeAgent, NodeConfig, serve
from kvoffload_sidecar.node.follow import PoolFollower
from kvoffload_sidecar.node.grants import NodePoolSpec, load_spec
from kvoffload_sidecar.node.kube import ApiConfig, KubeClient
from kvoffload_sidecar.node.node_metrics import serve_metrics
from kvoffload_sidecar.node.pools import PoolOptions, TenantPools
from kvoffload_sidecar.node.tenant_memory import MemoryServer, TenantMemory
from kvoffload_sidecar.tenants import parse_tenants


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvoffload node-agent", description=__doc__)
    p.add_argument("--csi-socket", default="/csi/csi.sock")
    p.add_argument("--node-id", required=True, help="the node's name ($(NODE_NAME))")
    source_arg = p.add_mutually_exclusive_group(required=True)
    source_arg.add_argument(
        "--node-pool-name", help="the KVOffloadNodePool to follow through the API"
    )
    source_arg.add_argument(
        "--node-pool", type=Path, help="a fixed node pool spec (JSON or YAML), no API"
    )
    p.add_argument("--api-server", default=None, help="API URL (default: in-cluster)")
    p.add_argument(
        "--pool-bytes",
        type=int,
        default=None,
        help="this node's pool (the holder's memory); grants summing past it are refused",
    )
    p.add_argument("--resync-seconds", type=int, default=300, help=argparse.SUPPRESS)
    p.add_argument("--state-dir", type=Path, default=Path("/var/lib/kvoffload-node"))
    p.add_argument("--publish-root", type=Path, default=Path("/var/lib/kubelet/pods"))
    p.add_argument("--prefault", action="store_true", help="allocate every tenant's pages now")
    p.add_argument(
        "--attest-peers",
        choices=("off", "cgroup"),
        default="off",
        help="cgroup: refuse a peer process whose cgroup names another pod (needs hostPID)",
    )
    p.add_argument("--proc-root", type=Path, default=Path("/proc"), help=argparse.SUPPRESS)
    p.add_argument(
        "--holder-socket",
        default=None,
        help="take the tenants' memfds from `kvoffload node-holder` (they outlive the agent)",
    )
    p.add_argument(
        "--max-namespaces",
        type=int,
        default=1,
        help="partitions of every tenant's pool, one namespace (model, layout, ...) each",
    )
    p.add_argument(
        "--cache-salt-tenants",
        type=parse_tenants,
        default=None,
        help="quotas by vLLM cache_salt inside every tenant's pool (the sidecar's --tenants)",
    )
    p.add_argument(
        "--metrics-listen",
        default=None,
        help="HOST:PORT of /metrics: every tenant pool once, labelled pool_id (off by default)",
    )
    p.add_argument("--client-timeout-s", type=float, default=60.0, help=argparse.SUPPRESS)
    p.add_argument("--detach-grace-s", type=float, default=2.0, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    source = None
    allocate = None
    if ns.holder_socket:
        source = functools.partial(holder.lend, ns.holder_socket)

        def allocate(tenant: str):  # the holder faults each range: its container is charged
            return functools.partial(holder.prefault, ns.holder_socket, tenant)

    fixed = load_spec(ns.node_pool) if ns.node_pool else NodePoolSpec(ns.node_pool_name, ())
    if ns.pool_bytes is not None and fixed.size_bytes > ns.pool_bytes:
        p.error(f"the tenants' shares sum to {fixed.size_bytes} bytes, past --pool-bytes")
    if not 1 <= ns.max_namespaces <= 1024:
        p.error("--max-namespaces must be in 1..1024")
    options = PoolOptions(
        max_namespaces=ns.max_namespaces,
        salt_tenants=ns.cache_salt_tenants,
        client_timeout_s=ns.client_timeout_s,
        detach_grace_s=ns.detach_grace_s,
    )
    memory = TenantMemory(fixed, prefault=ns.prefault, source=source)
    config = NodeConfig(node_id=ns.node_id, state_dir=ns.state_dir, publish_root=ns.publish_root)
    follower = None
    if ns.node_pool_name and ns.pool_bytes is None:
        p.error("--node-pool-name needs --pool-bytes (the holder's memory: grants past it fail)")
    agent_ref: list[NodeAgent] = []
    if ns.node_pool_name:
        api = ApiConfig(ns.api_server) if ns.api_server else ApiConfig.in_cluster()
        follower = PoolFollower(
            name=ns.node_pool_name,
            node_id=ns.node_id,
            pool_bytes=ns.pool_bytes,
            memory=memory,
            bindings=lambda: agent_ref[0].bindings() if agent_ref else [],
            client=KubeClient(api),
            resync_s=ns.resync_seconds,
            on_grants=lambda: agent_ref[0].reconsider() if agent_ref else 0,
        )
        access = Access(follower.spec, follower.precondition)
    else:
        access = Access(lambda: fixed)
    # every pod socket's peers: memory.sock, pool.sock and session.sock alike
    attest = CgroupAttestor(ns.proc_root).pod_uid if ns.attest_peers == "cgroup" else None
    pools = TenantPools(
        options,
        allocate=allocate,
        refusal=access.refusal,
        node_pool=fixed.name,
        node=ns.node_id,
        attest=attest,
    )
    metrics = serve_metrics(pools, ns.metrics_listen) if ns.metrics_listen else None
    memory.subscribe(pools.add)  # each tenant's pool, over its memfd (adopting its index)
    server = MemoryServer(memory, attest=attest, refusal=access.refusal)
    agent = NodeAgent(
        config,
        access,
        server,
        on_change=follower.changed if follower is not None else lambda: None,
        pools=pools,
    )
    agent_ref.append(agent)
    if follower is not None:
        follower.start()
    grpc_server = serve(agent, ns.csi_socket)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    if metrics is not None:
        print(f"node agent metrics on port {metrics.port}", flush=True)
    print(f"node agent serving {ns.csi_socket} ({len(agent.bindings())} bindings)", flush=True)
    done.wait()
    if follower is not None:
        follower.stop()
    grpc_server.stop(2).wait()
    if metrics is not None:
        metrics.close()
    pools.close()
    server.close()
    memory.close()
    return 0
