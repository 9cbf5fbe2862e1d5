"""What an injection adds to a pod, by name, path and port (pure). `render` writes these; the
decision (`conflicts.clashes`) skips a pod that already uses one, before anything is rendered:
a second volume or container of one name, or a device where a mount goes, the API server
refuses; a second listener on a port fails at runtime."""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload_operator.policy import Delivery, Policy

SIDECAR_NAME = "kvoffload-sidecar"
INSTALLER_NAME = "kvoffload-connector-install"
POOL_VOLUME, RUN_VOLUME, PYTHON_VOLUME = "kvoffload-pool", "kvoffload-run", "kvoffload-python"
KVOFFLOAD_DIR = "/kvoffload"
POOL_DIR, RUN_DIR, PYTHON_DIR = "/kvoffload/pool", "/kvoffload/run", "/kvoffload/python"
# placement node: the node agent's CSI inline volume, where it binds this pod's sockets
NODE_VOLUME, NODE_DIR, NODE_DRIVER = "kvoffload-node", "/var/run/kvoffload", "node.kvoffload.io"
GRPC_PORT, METRICS_PORT = 9400, 9401  # the sidecar's listeners, on the pod's IP
# the vLLM container's PYTHONPATH from a valueFrom source, moved aside so ours goes first
USER_PYTHONPATH_ENV = "KVOFFLOAD_USER_PYTHONPATH"


@dataclass(frozen=True)
class Reserved:
    """What one policy's rendering adds: container and volume names, the paths mounted in the
    vLLM container, env names added there as new entries, the ports the sidecar binds."""

    containers: tuple[str, ...]
    volumes: tuple[str, ...]
    paths: tuple[str, ...]
    env: tuple[str, ...]
    ports: tuple[int, ...]


def reserved(policy: Policy) -> Reserved:
    installer = policy.connector.delivery is Delivery.INIT_CONTAINER
    containers = [INSTALLER_NAME] if installer else []
    if not policy.pool.node:
        containers.append(SIDECAR_NAME)
    volumes = [NODE_VOLUME] if policy.pool.node else [POOL_VOLUME, RUN_VOLUME]
    paths = [NODE_DIR] if policy.pool.node else [POOL_DIR, RUN_DIR]
    if installer:
        volumes.append(PYTHON_VOLUME)
        paths.append(PYTHON_DIR)
    return Reserved(
        containers=tuple(containers),
        volumes=tuple(volumes),
        paths=tuple(paths),
        env=(USER_PYTHONPATH_ENV,) if installer else (),
        ports=() if policy.pool.node else (GRPC_PORT, METRICS_PORT),
    )
