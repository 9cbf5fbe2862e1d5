"""The CSI Identity and Node services the kubelet calls (the CSI spec's own messages, v1.12).

NodePublishVolume turns one pod's inline volume into that pod's sockets: it checks the kubelet's
pod fields, decides whether the requested tenant is granted to the pod (access.py), creates
`target_path`, records the binding, binds `memory.sock` in it and, with the slot protocol
served (pools.py), the pod's `pool.sock` on its tenant's pool (and `session.sock`), before it
answers. A tenant not granted, or not decidable yet (the CSIDriver or the grants not read),
fails no mount: the kubelet would hold the pod in ContainerCreating. The pod's sockets refuse
instead, with the reason, so it serves without the pool; it gets its tenant when the agent
accepts grants that admit it (`reconsider`). NodeUnpublishVolume undoes it and answers OK for a
volume it does not know, as the spec requires. Codes follow the spec's tables, for what only a
caller that is not the kubelet sends: INVALID_ARGUMENT for requests this driver cannot serve,
PERMISSION_DENIED for pod fields that are not the kubelet's, ALREADY_EXISTS for the same volume
and path asked with another pod, tenant or group.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
from kvoffload.csi.v1 import csi_pb2, csi_pb2_grpc

from kvoffload_sidecar.node.access import Access
from kvoffload_sidecar.node.bindings import SOCKET_NAME, Binding, BindingStore
from kvoffload_sidecar.node.identity import IdentityError, parse_volume_context
from kvoffload_sidecar.node.pools import POOL_SOCKET, SESSION_SOCKET, TenantPools
from kvoffload_sidecar.node.status_dir import make_status_dir, remove_status_dir
from kvoffload_sidecar.node.tenant_memory import MemoryServer

log = logging.getLogger(__name__)

DRIVER_NAME = "node.kvoffload.io"
VENDOR_VERSION = "0.1.0"


@dataclass(frozen=True)
class NodeConfig:
    node_id: str  # the Kubernetes node name (NodeGetInfo)
    state_dir: Path  # bindings survive agent restarts here
    publish_root: Path  # every target_path must lie under it (the kubelet's pods directory)


class _Refusal(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _under(root: Path, path: str) -> bool:
    p = Path(os.path.normpath(path))
    return p.is_absolute() and str(p) == path.rstrip("/") and root in p.parents


class NodeAgent(csi_pb2_grpc.IdentityServicer, csi_pb2_grpc.NodeServicer):
    """Both CSI services over one state: the binding store and the memory server."""

    def __init__(
        self,
        config: NodeConfig,
        access: Access,
        memory: MemoryServer,
        *,
        on_change: Callable[[], None] = lambda: None,
        pools: TenantPools | None = None,
    ) -> None:
        """`access` decides at every publish whether the pod gets its tenant (the grants may
        change while the agent runs), and says why not on its sockets (`memory` and `pools`
        are built with its `refusal`); `on_change()` is called after every publish, unpublish
        and later grant (the node's status counts pods); `pools` serves each pod's slot
        protocol on its tenant's pool (None: memory.sock only)."""
        self._config = config
        self._access = access
        self._on_change = on_change
        self._memory = memory
        self._pools = pools
        self._store = BindingStore(config.state_dir)
        self._bindings: dict[tuple[str, str], Binding] = {}
        self._lock = threading.Lock()  # publish and unpublish of any volumes, one at a time
        self.restore()

    def restore(self) -> None:
        """Serve again every socket a previous agent published (the kubelet will not ask)."""
        for b in self._store.load():
            if not os.path.isdir(b.target_path):
                log.info("pod %s is gone (no %s): binding dropped", b.pod.describe(), b.target_path)
                self._store.remove(b.volume_id, b.target_path)
                continue
            self._make_status_dir(b)
            self._memory.attach(b)
            self._attach_pool(b)
            self._bindings[(b.volume_id, b.target_path)] = b
        self.reconsider()

    def reconsider(self) -> int:
        """Grant every published pod that lacks its tenant's grant and that the grants in force
        admit now (the agent calls it after each accepted generation and once its CSIDriver
        passes): its record says so before its sockets serve the tenant. Pods granted already
        keep their grant whatever the grants say. Returns how many were granted."""
        granted = 0
        with self._lock:
            for key, b in list(self._bindings.items()):
                if b.granted or not self._access.admits(b):
                    continue
                now = replace(b, granted=True)
                self._store.save(now)
                self._bindings[key] = now
                self._memory.rebind(now)
                self._attach_pool(now)
                granted += 1
                log.info("pod %s: tenant %s granted, its sockets serve it", now.pod.describe(),
                         now.tenant)  # fmt: skip
        if granted:
            self._on_change()
        return granted

    @staticmethod
    def _make_status_dir(b: Binding) -> None:
        try:
            make_status_dir(b.target_path, b.mount_group)
        except OSError as e:  # the sockets are served: the pod's status files go unwritten
            log.error("pod %s: no status directory: %s", b.pod.describe(), e)

    def _attach_pool(self, b: Binding) -> None:
        if self._pools is None:
            return
        try:
            self._pools.attach(b)
        except (OSError, RuntimeError) as e:  # memory.sock is served: the pod runs without
            log.error("pod %s: pool.sock not served: %s", b.pod.describe(), e)

    def bindings(self) -> list[Binding]:
        with self._lock:
            return list(self._bindings.values())

    # Identity

    def GetPluginInfo(self, request, context):  # noqa: N802 (gRPC method names)
        return csi_pb2.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=VENDOR_VERSION)

    def GetPluginCapabilities(self, request, context):  # noqa: N802
        # A node-only plugin: no controller service, no topology.
        return csi_pb2.GetPluginCapabilitiesResponse()

    def Probe(self, request, context):  # noqa: N802
        return csi_pb2.ProbeResponse(ready={"value": True})

    # Node

    def NodeGetInfo(self, request, context):  # noqa: N802
        return csi_pb2.NodeGetInfoResponse(node_id=self._config.node_id)

    def NodeGetCapabilities(self, request, context):  # noqa: N802
        rpc = csi_pb2.NodeServiceCapability.RPC
        return csi_pb2.NodeGetCapabilitiesResponse(
            capabilities=[csi_pb2.NodeServiceCapability(rpc=rpc(type=rpc.VOLUME_MOUNT_GROUP))]
        )

    def NodePublishVolume(self, request, context):  # noqa: N802
        try:
            binding = self._check_publish(request)
            with self._lock:
                self._publish(binding)
        except _Refusal as r:
            log.info("NodePublishVolume %s refused: %s", request.volume_id, r)
            context.abort(r.code, str(r))
        self._on_change()
        return csi_pb2.NodePublishVolumeResponse()

    def NodeUnpublishVolume(self, request, context):  # noqa: N802
        if not request.volume_id or not request.target_path:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "volume_id and target_path are required"
            )
        if not _under(self._config.publish_root, request.target_path):
            # never unlink or remove anything outside the kubelet's pod directories
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"target_path must be a normal path under {self._config.publish_root}",
            )
        key = (request.volume_id, request.target_path)
        with self._lock:
            self._memory.detach(*key)
            if self._pools is not None:
                self._pools.detach(*key)
            self._bindings.pop(key, None)
            self._store.remove(*key)
            # Remove what this driver created there, and nothing else.
            for name in (SOCKET_NAME, POOL_SOCKET, SESSION_SOCKET):
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    os.unlink(os.path.join(request.target_path, name))
            try:
                remove_status_dir(request.target_path)
                os.rmdir(request.target_path)
            except FileNotFoundError:
                pass
            except OSError as e:
                context.abort(
                    grpc.StatusCode.INTERNAL, f"{request.target_path} not removed: {e.strerror}"
                )
        self._on_change()
        return csi_pb2.NodeUnpublishVolumeResponse()

    def _check_publish(self, request) -> Binding:
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if not request.volume_id:
            raise _Refusal(bad, "volume_id is required")
        if not request.target_path:
            raise _Refusal(bad, "target_path is required")
        if not _under(self._config.publish_root, request.target_path):
            raise _Refusal(
                bad, f"target_path must be a normal path under {self._config.publish_root}"
            )
        if not request.HasField("volume_capability"):
            raise _Refusal(bad, "volume_capability is required")
        if request.volume_capability.WhichOneof("access_type") != "mount":
            raise _Refusal(bad, "only the mount access type is served (a directory, no block)")
        try:
            asked = parse_volume_context(request.volume_context)
        except IdentityError as e:
            raise _Refusal(bad, str(e)) from None
        # The kubelet names target_path after the pod's uid (<root>/<uid>/volumes/...), and a
        # pod spec cannot know its uid before it exists: a context whose uid differs from the
        # path's was not written by the kubelet (a CSIDriver without podInfoOnMount passes the
        # pod's own volumeAttributes through unchanged, pod.* keys included).
        path_uid = Path(request.target_path).relative_to(self._config.publish_root).parts[0]
        if path_uid != asked.pod.uid:
            raise _Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                "the volume context's pod uid is not the kubelet's (target_path names another pod)",
            )
        group = request.volume_capability.mount.volume_mount_group
        if group and not group.isdigit():
            raise _Refusal(bad, f"volume_mount_group {group!r} is not a numeric group id")
        return Binding(
            volume_id=request.volume_id,
            target_path=request.target_path,
            pod=asked.pod,
            tenant=asked.tenant,
            mount_group=int(group) if group else None,
            granted=False,  # decided under the publish lock (`_publish`)
        )

    def _publish(self, b: Binding) -> None:
        key = (b.volume_id, b.target_path)
        known = self._bindings.get(key)
        # under the lock `reconsider` takes: a generation accepted meanwhile either admits this
        # pod here or finds its binding there
        b = replace(b, granted=known.granted if known is not None else self._access.admits(b))
        if known is not None:
            if not known.same_request(b):
                raise _Refusal(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"volume {b.volume_id} is published at {b.target_path} for another "
                    "pod, tenant or group",
                )
            pools = self._pools
            if os.path.exists(b.socket_path) and (pools is None or pools.knows(*key)):
                return  # the kubelet retried a publish that succeeded
        parent = os.path.dirname(b.target_path)
        if not os.path.isdir(parent):
            raise _Refusal(
                grpc.StatusCode.FAILED_PRECONDITION, f"{parent} does not exist (the CO makes it)"
            )
        try:
            os.mkdir(b.target_path, 0o755)
        except FileExistsError:
            if os.path.islink(b.target_path) or not os.path.isdir(b.target_path):
                raise _Refusal(
                    grpc.StatusCode.FAILED_PRECONDITION, f"{b.target_path} is not a directory"
                ) from None
        if b.mount_group is not None:
            os.chown(b.target_path, -1, b.mount_group)
            os.chmod(b.target_path, 0o2750)
        else:
            os.chmod(b.target_path, 0o755)
        self._make_status_dir(b)  # the one spot the pod writes: its connectors' status files
        self._store.save(b)  # before the socket exists: a crash leaves a record, never an orphan
        self._memory.attach(b)
        self._attach_pool(b)
        self._bindings[key] = b
        if not b.granted:  # once per pod: its sockets then say it at every request
            code, why = self._access.refusal(b)
            log.warning(
                "pod %s published without its tenant (%s: %s): its sockets refuse, it serves "
                "without the node pool",
                b.pod.describe(), code, why,
            )  # fmt: skip


def serve(agent: NodeAgent, csi_socket: str, *, workers: int = 4) -> grpc.Server:
    """Start both services on `csi_socket` (node-driver-registrar's `--csi-address`)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    csi_pb2_grpc.add_IdentityServicer_to_server(agent, server)
    csi_pb2_grpc.add_NodeServicer_to_server(agent, server)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(csi_socket)
    server.add_insecure_port(f"unix://{csi_socket}")
    server.start()
    os.chmod(csi_socket, 0o600)
    return server
