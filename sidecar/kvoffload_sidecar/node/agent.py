"""`kvoffload node-agent`: the node agent (CSI services + tenant memory).

Until the API watch exists the node pool spec comes from `--node-pool FILE` (the same fields as
the `KVOffloadNodePool` object); the slot protocol inside each tenant is not served yet
(docs/NODE.md, Open).
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
from kvoffload_sidecar.node.attest import CgroupAttestor
from kvoffload_sidecar.node.csi import NodeAgent, NodeConfig, serve
from kvoffload_sidecar.node.grants import load_spec
from kvoffload_sidecar.node.tenant_memory import MemoryServer, TenantMemory


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvoffload node-agent", description=__doc__)
    p.add_argument("--csi-socket", default="/csi/csi.sock")
    p.add_argument("--node-id", required=True, help="the node's name ($(NODE_NAME))")
    p.add_argument("--node-pool", type=Path, required=True, help="node pool spec (JSON or YAML)")
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
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    spec = load_spec(ns.node_pool)
    source = None
    if ns.holder_socket:
        source = functools.partial(holder.lend, ns.holder_socket)
    memory = TenantMemory(spec, prefault=ns.prefault, source=source)
    attest = CgroupAttestor(ns.proc_root).pod_uid if ns.attest_peers == "cgroup" else None
    server = MemoryServer(lambda: spec, memory, attest=attest)
    config = NodeConfig(node_id=ns.node_id, state_dir=ns.state_dir, publish_root=ns.publish_root)
    agent = NodeAgent(config, lambda: spec, server)
    grpc_server = serve(agent, ns.csi_socket)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(f"node agent serving {ns.csi_socket} ({len(agent.bindings())} bindings)", flush=True)
    done.wait()
    grpc_server.stop(2).wait()
    server.close()
    memory.close()
    return 0
