"""The slot protocol inside each tenant: one `Pool` per tenant memfd, and each published pod's
own gRPC server (`pool.sock`) and framed session socket (`session.sock`) on its tenant's Pool.

The `Pool` is the sidecar's (index in the memory, namespaces, cache_salt quotas, engine locks),
over the tenant's memfd instead of a pool file (`kvoffload_sidecar.memfd_region`). It is built
when the tenant's memfd is accepted; after an agent restart the holder lends the same memfd
again and the new Pool adopts the index it holds, as a restarted sidecar adopts its pool file.

A pod's sockets sit beside its `memory.sock`, in the directory the kubelet published, with the
same mode and group rules (0666, or 0660 and the pod's fsGroup). The servicer of a pod's server
holds only its bound tenant's Pool: the tenant comes from the binding, never from a request.
Register answers name that tenant (`RegisterResponse.tenant_memory`) and no path: offsets are
into the memfd the pod gets from `memory.sock`. No presence map is offered (empty name).

A pod that may not reach its tenant's Pool, now or yet (its binding lacks the grant, or its
tenant has no Pool on this node), gets a refusing `pool.sock` instead: a server holding no Pool,
whose every call answers the reason with its gRPC code (PERMISSION_DENIED or UNAVAILABLE), and
no `session.sock`. The connector then serves without the pool and says why; when the pod gets
its grant or its tenant its Pool, the refusing server is replaced by the pod's real one.

Every pod server runs on one asyncio loop in one thread (the sidecar's servicer is asynchronous;
Pool calls take microseconds under the Pool's lock), and its framed sessions on their own
threads as in the sidecar. A pod's gRPC server listens on a private abstract address, and its
`pool.sock` is the agent's front (front.py), which bounds its connections and attests each
peer before splicing it there; `session.sock` attests each peer as it accepts it (attest.py),
refusing one outside the pod with a PERMISSION_DENIED `SessionError` frame before reading it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from kvoffload.v1 import pool_pb2 as pb
from kvoffload.v1 import pool_pb2_grpc as pb_grpc

from kvoffload_sidecar.errors import PoolError
from kvoffload_sidecar.frames import FramedSessions
from kvoffload_sidecar.memfd_region import FdBacking
from kvoffload_sidecar.memory_room import MemoryRoom, memory_room, pool_shortfall
from kvoffload_sidecar.metrics import SidecarMetrics
from kvoffload_sidecar.node.access import PERMISSION_DENIED, UNAVAILABLE, Refusal, not_granted
from kvoffload_sidecar.node.attest import NOT_IN_POD, Attest, peer_in_pod
from kvoffload_sidecar.node.bindings import Binding
from kvoffload_sidecar.node.front import OUTSIDER_CONNECTION_AGE_MS, PoolFront, private_address
from kvoffload_sidecar.node.status_dir import STATUS_DIR
from kvoffload_sidecar.node.tenant_memory import TenantRegion, bind_in_dir, set_socket_owner
from kvoffload_sidecar.pool import Pool, PoolSettings, PoolStats
from kvoffload_sidecar.server import (
    MAX_MESSAGE_BYTES,
    SERVICE_NAME,
    PoolServicer,
    add_servicer,
    new_server,
)
from kvoffload_sidecar.tenants import TenantsConfig

log = logging.getLogger(__name__)

POOL_SOCKET = "pool.sock"
SESSION_SOCKET = "session.sock"
_BACKLOG = 64
_CALL_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class PoolOptions:
    """How every tenant's Pool is built and its pods served (the agent's flags)."""

    max_namespaces: int = 1
    eviction: str = "lru"
    client_timeout_s: float = 60.0
    detach_grace_s: float = 2.0
    salt_tenants: TenantsConfig | None = None  # cache_salt quotas inside every tenant's pool
    prefault: bool = True  # False: every slot ready at once (tests only)
    prefault_chunk_bytes: int = 64 << 20
    max_sessions: int = 64  # framed sessions per pod socket
    unpublish_grace_s: float = 1.0  # in-flight calls of a pod whose volume goes

    @property
    def reap_interval_s(self) -> float:
        """As the sidecar's: a quarter of the idle timeout or half the detach grace."""
        period = self.client_timeout_s / 4
        if self.detach_grace_s > 0:
            period = min(period, self.detach_grace_s / 2)
        return min(10.0, max(0.1, period))

    def settings(self, size: int) -> PoolSettings:
        return PoolSettings(
            pool_size=size,
            pool_dir=None,
            eviction=self.eviction,
            max_namespaces=self.max_namespaces,
            prefault_chunk_bytes=self.prefault_chunk_bytes,
            client_timeout_s=self.client_timeout_s,
            detach_grace_s=self.detach_grace_s,
            prefault=self.prefault,
            tenants=self.salt_tenants,
        )


@dataclass
class PodFramedSessions(FramedSessions):
    """The framed session socket in a pod's directory: bound through the directory (the path
    may exceed `sun_path`), mode and group set as on `memory.sock`."""

    directory: str = ""
    mode: int = 0o666
    group: int | None = None

    async def start(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            bind_in_dir(listener, self.directory, self.path.name)
            set_socket_owner(self.directory, self.path.name, self.mode, self.group)
            listener.listen(_BACKLOG)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        threading.Thread(
            target=self._accept_forever,
            args=(listener,),
            name="kvoffload-node-framed",
            daemon=True,
        ).start()


@dataclass
class PodServer:
    """One published pod's servers over its tenant's Pool."""

    binding: Binding
    server: grpc.aio.Server
    servicer: PoolServicer
    health: health.aio.HealthServicer
    frames: PodFramedSessions
    front: PoolFront  # its pool.sock


class RefusingServicer(pb_grpc.KVPoolServicer):
    """KVPool for a pod that may not reach a Pool: it holds none, and every method answers
    `why()` (asked at each call: the reason as it stands) with that gRPC code."""

    def __init__(self, why: Callable[[], Refusal]) -> None:
        self._why = why

    async def refuse(self, context: Any) -> None:
        code, message = self._why()
        await context.abort(grpc.StatusCode[code], message)


def _refusing(name: str) -> Callable[..., Any]:
    async def method(self: RefusingServicer, request: Any, context: Any) -> None:
        await self.refuse(context)

    method.__name__ = name
    return method


for _method in pb.DESCRIPTOR.services_by_name["KVPool"].methods:
    setattr(RefusingServicer, _method.name, _refusing(_method.name))


@dataclass
class RefusingServer:
    """A pod's `pool.sock` while it may not reach its tenant's Pool."""

    binding: Binding
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    front: PoolFront  # its pool.sock


@dataclass
class TenantPool:
    tenant: str
    pool: Pool
    metrics: SidecarMetrics
    reaper: asyncio.Task[None] | None = None
    pods: dict[tuple[str, str], PodServer] = field(default_factory=dict)


@dataclass(frozen=True)
class SharedPool:
    """A tenant's pool as its sharers see it (Stats' SharedPool, the agent's metrics): one
    `pool_id` for every pod of the tenant on this node, so capacity is counted once."""

    pool_id: str  # "<node pool>/<node>/<tenant>/<generation>"
    node_pool: str
    node: str
    tenant: str
    generation: str
    attached_pods: int  # pods whose pool.sock serves this pool now
    active_pods: int  # of those, pods with a live client registered through their pool.sock
    live_clients: int  # live registered clients, every pod and namespace
    capacity_bytes: int  # the tenant's memfd
    used_bytes: int  # committed or reserved slots, every namespace
    stats: PoolStats

    def to_proto(self, out: pb.SharedPool) -> None:
        out.pool_id = self.pool_id
        out.node_pool = self.node_pool
        out.node = self.node
        out.tenant = self.tenant
        out.attached_pods = self.attached_pods
        out.active_pods = self.active_pods
        out.live_clients = self.live_clients
        out.capacity_bytes = self.capacity_bytes
        out.used_bytes = self.used_bytes


def pool_id(node_pool: str, node: str, tenant: str, generation: str) -> str:
    """The shared pool's identifier: names are DNS labels or subdomains (no "/" in them), the
    generation is the pool's own (kept by an agent restart that adopts the index)."""
    return f"{node_pool}/{node}/{tenant}/{generation}"


class TenantPools:
    """Every tenant's Pool in this agent, and the pod servers on them.

    `add(region)` is `TenantMemory.subscribe`'s listener. `allocate(tenant)`, when given, is
    how that tenant's pages are allocated for the pre-fault (the holder does it: its container
    is charged); without it the agent allocates them itself, and a tenant whose pool does not
    fit the agent container's memory limit gets no pool (`problems`).
    """

    def __init__(
        self,
        options: PoolOptions | None = None,
        *,
        allocate: Callable[[str], Callable[[int, int], None]] | None = None,
        socket_mode: int = 0o666,
        room: Callable[[], MemoryRoom | None] = memory_room,
        refusal: Callable[[Binding], Refusal] = not_granted,
        node_pool: str = "",
        node: str = "",
        attest: Attest | None = None,
    ) -> None:
        """`refusal(binding)`: what an ungranted binding's `pool.sock` answers (access.py);
        `node_pool` and `node` name the shared pools (`SharedPool.pool_id`); `attest(pid)`
        places the peers of `pool.sock` and `session.sock` (attest.py; None: not checked)."""
        self.options = options or PoolOptions()
        self.node_pool = node_pool
        self.node = node
        self._refusal = refusal
        self._allocate = allocate
        self._mode = socket_mode
        self._room = room
        self._lock = threading.Lock()  # tenants and pods, across CSI threads and the loop
        self._tenants: dict[str, TenantPool] = {}
        self._pods: dict[tuple[str, str], TenantPool] = {}
        self._waiting: dict[tuple[str, str], Binding] = {}  # pods whose tenant has no pool yet
        self._refusing: dict[tuple[str, str], RefusingServer] = {}  # their pool.sock, and others'
        self.problems: dict[str, str] = {}  # tenant -> why it has no pool
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="node-pools", daemon=True
        )
        self._thread.start()
        self._closed = False
        self._attest = attest
        self._outsider: grpc.aio.Server | None = None  # answers peers outside their pod
        self._outsider_address = None
        if attest is not None:
            self._outsider_address = private_address()
            self._outsider = self._call(self._start_outsider(self._outsider_address.grpc))

    # -- tenants -----------------------------------------------------------------------------

    def add(self, region: TenantRegion) -> None:
        """Build and start `region`'s tenant's Pool (adopting an index it holds)."""
        with self._lock:
            if self._closed or region.tenant in self._tenants:
                return
        problem = self._room_problem(region)
        if problem is not None:
            self.problems[region.tenant] = problem
            log.error("tenant %s gets no pool: %s", region.tenant, problem)
            return
        allocate = self._allocate(region.tenant) if self._allocate is not None else None
        backing = FdBacking(region.fd, f"tenant {region.tenant}'s memory", allocate)
        pool = Pool(self.options.settings(region.size), backing=backing)
        try:
            pool.start()
        except (OSError, ValueError, PoolError) as exc:
            pool.close()
            self.problems[region.tenant] = str(exc)
            log.error("tenant %s gets no pool: %s", region.tenant, exc)
            return
        tp = TenantPool(region.tenant, pool, SidecarMetrics(pool))
        tp.reaper = self._call(self._start_reaper(tp))
        with self._lock:
            self._tenants[region.tenant] = tp
            self.problems.pop(region.tenant, None)
            waiting = [b for b in self._waiting.values() if b.tenant == region.tenant]
            for b in waiting:
                del self._waiting[(b.volume_id, b.target_path)]
        a = pool.adoption
        log.info(
            "tenant %s: pool of %d bytes, %s (%s%d committed blocks in %d namespace(s))",
            region.tenant,
            region.size,
            a.outcome,
            f"{a.reason}; " if a.reason else "",
            a.adopted_blocks,
            a.adopted_namespaces,
        )
        for b in waiting:  # pods published (or restored) before their tenant had a pool
            try:
                self.attach(b)
            except (OSError, RuntimeError) as e:
                log.error("pod %s: pool.sock not served: %s", b.pod.describe(), e)

    def _room_problem(self, region: TenantRegion) -> str | None:
        if self._allocate is not None:
            log.info(
                "tenant %s: the holder allocates its pages (its container is charged): the "
                "agent container's memory limit is not checked",
                region.tenant,
            )
            return None
        with self._lock:
            pending = sum(
                tp.pool.region.size - tp.pool.region.prefaulted_bytes
                for tp in self._tenants.values()
            )
        resident = os.fstat(region.fd).st_blocks * 512
        return pool_shortfall(
            region.size + pending,
            resident,
            self._room(),
            container="the node agent container",
            remedy="take the memory from the holder (--holder-socket), raise the agent "
            "container's memory limit or lower the tenants' shares",
        )

    def pool(self, tenant: str) -> Pool | None:
        with self._lock:
            tp = self._tenants.get(tenant)
        return tp.pool if tp is not None else None

    def tenants(self) -> list[str]:
        """Tenants with a Pool in this agent, by name."""
        with self._lock:
            return sorted(self._tenants)

    def metrics_of(self, tenant: str) -> SidecarMetrics | None:
        with self._lock:
            tp = self._tenants.get(tenant)
        return tp.metrics if tp is not None else None

    def shared(self, tenant: str) -> SharedPool | None:
        """The tenant's pool and who shares it now; None when it has no Pool here."""
        with self._lock:
            tp = self._tenants.get(tenant)
        return self._shared(tp) if tp is not None else None

    def _shared(self, tp: TenantPool) -> SharedPool:
        stats = tp.pool.stats()
        live = tp.pool.live_client_ids()
        with self._lock:
            registered = [pod.servicer.registered_clients for pod in tp.pods.values()]
        active = sum(1 for ids in registered if ids is not None and not ids.isdisjoint(live))
        return SharedPool(
            pool_id=pool_id(self.node_pool, self.node, tp.tenant, stats.pool_generation),
            node_pool=self.node_pool,
            node=self.node,
            tenant=tp.tenant,
            generation=stats.pool_generation,
            attached_pods=len(registered),
            active_pods=active,
            live_clients=len(live),
            capacity_bytes=stats.pool_bytes,
            used_bytes=sum(ns.used_bytes for ns in stats.namespaces),
            stats=stats,
        )

    def _fill_shared(self, tp: TenantPool, servicer: PoolServicer, out: pb.SharedPool) -> None:
        """Stats' SharedPool for a pod's server (on the loop thread, where Register adds to
        `registered_clients`: the ids no longer live are dropped here)."""
        ids = servicer.registered_clients
        if ids is not None:
            ids.intersection_update(tp.pool.live_client_ids())
        self._shared(tp).to_proto(out)

    async def _start_reaper(self, tp: TenantPool) -> asyncio.Task[None]:
        return asyncio.create_task(self._reap(tp))

    async def _reap(self, tp: TenantPool) -> None:
        """The sidecar's reaper for one tenant's Pool: idle clients, dead engines, and the
        memory changed under it (its sessions then end: the connectors register again)."""
        while True:
            await asyncio.sleep(self.options.reap_interval_s)
            try:
                if tp.pool.check_file():
                    for pod in list(tp.pods.values()):
                        pod.servicer.cancel_sessions()
                        pod.frames.close_all()
            except Exception:  # noqa: BLE001
                log.exception("tenant %s: checking its memory failed", tp.tenant)
            try:
                tp.pool.reap_idle_clients()
            except Exception:  # noqa: BLE001
                log.exception("tenant %s: reaping idle clients failed", tp.tenant)

    # -- pods --------------------------------------------------------------------------------

    def knows(self, volume_id: str, target_path: str) -> bool:
        """That pod's `pool.sock` is served (by its servers or a refusing one)."""
        key = (volume_id, target_path)
        with self._lock:
            return key in self._pods or key in self._refusing

    def serving(self, volume_id: str, target_path: str) -> bool:
        with self._lock:
            return (volume_id, target_path) in self._pods

    def attach(self, binding: Binding) -> bool:
        """Serve `pool.sock` and `session.sock` in the pod's (existing) directory on its
        tenant's Pool, replacing the servers of the same volume. False (logged) when the pod
        gets a refusing `pool.sock` instead (module docstring): a binding without its grant
        (`refusal`), or a granted one whose tenant has no pool yet (UNAVAILABLE with the
        reason), which gets its servers once its tenant's pool is built (`add`)."""
        key = (binding.volume_id, binding.target_path)
        self.detach(*key)
        with self._lock:
            tp = self._tenants.get(binding.tenant) if binding.granted else None
            if binding.granted and tp is None:
                self._waiting[key] = binding
        if tp is None:
            if binding.granted:
                why = functools.partial(self._no_pool, binding.tenant)
                log.warning(
                    "pod %s: pool.sock refuses until tenant %s has a pool (%s)",
                    binding.pod.describe(),
                    binding.tenant,
                    why()[1],
                )
            else:
                why = functools.partial(self._refusal, binding)
            refusing = self._call(self._start_refusing(binding, why))
            with self._lock:
                self._refusing[key] = refusing
            return False
        pod = self._call(self._start_pod(tp, binding))
        with self._lock:
            tp.pods[key] = pod
            self._pods[key] = tp
        return True

    def _no_pool(self, tenant: str) -> Refusal:
        why = self.problems.get(tenant, "its memory is not on this node yet")
        return UNAVAILABLE, f"tenant {tenant!r} has no pool on this node: {why}"

    def detach(self, volume_id: str, target_path: str) -> bool:
        """Stop that pod's servers (their sessions end: the clients detach) and remove its
        sockets; False when none were served."""
        key = (volume_id, target_path)
        with self._lock:
            self._waiting.pop(key, None)
            refusing = self._refusing.pop(key, None)
            tp = self._pods.pop(key, None)
            pod = tp.pods.pop(key, None) if tp is not None else None
        if refusing is not None:
            self._call(self._stop_refusing(refusing))
        if pod is None:
            return refusing is not None
        self._call(self._stop_pod(pod, self.options.unpublish_grace_s))
        return True

    def _socket_mode(self, b: Binding) -> int:
        return self._mode if b.mount_group is None else self._mode & 0o660

    def _front(self, b: Binding, server: grpc.aio.Server) -> PoolFront:
        """The pod's `pool.sock` in front of `server` (bound to a new private address)."""
        backend = private_address()
        server.add_insecure_port(backend.grpc)
        return PoolFront(
            b.target_path,
            POOL_SOCKET,
            backend,
            b.pod.uid,
            mode=self._socket_mode(b),
            group=b.mount_group,
            attest=self._attest,
            outsider=self._outsider_address,
            max_connections=self.options.max_sessions,
        )

    def _admit(self, b: Binding, conn: socket.socket) -> str | None:
        """`session.sock`'s check of an accepted connection (FramedSessions.admit)."""
        return None if peer_in_pod(conn, b.pod.uid, self._attest) else NOT_IN_POD

    @staticmethod
    async def _start_outsider(address: str) -> grpc.aio.Server:
        server = grpc.aio.server(  # its connections end soon: a refused peer's place frees
            options=[
                ("grpc.max_connection_age_ms", OUTSIDER_CONNECTION_AGE_MS),
                ("grpc.max_connection_age_grace_ms", OUTSIDER_CONNECTION_AGE_MS),
                ("grpc.so_reuseport", 0),
            ]
        )
        add_servicer(RefusingServicer(lambda: (PERMISSION_DENIED, NOT_IN_POD)), server)
        server.add_insecure_port(address)
        await server.start()
        return server

    async def _start_refusing(self, b: Binding, why: Callable[[], Refusal]) -> RefusingServer:
        server = new_server()
        add_servicer(RefusingServicer(why), server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        front = self._front(b, server)
        dfd = os.open(b.target_path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            with contextlib.suppress(FileNotFoundError):  # no session.sock: nothing to serve
                os.unlink(SESSION_SOCKET, dir_fd=dfd)
        finally:
            os.close(dfd)
        try:
            await server.start()
            front.start()
        except BaseException:
            await server.stop(None)
            raise
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        return RefusingServer(b, server, health_servicer, front)

    @staticmethod
    async def _stop_refusing(refusing: RefusingServer) -> None:
        refusing.front.stop()
        try:
            await refusing.server.stop(0)
        finally:
            refusing.front.close_all()

    async def _start_pod(self, tp: TenantPool, b: Binding) -> PodServer:
        servicer = PoolServicer(tp.pool, tp.metrics)
        servicer.tenant_memory = b.tenant
        # Stats relays the pod's connector status files, as a sidecar's relays its pod's: from
        # the volume's status/, the one directory the pod may write
        servicer.status_dir = Path(b.target_path) / STATUS_DIR
        servicer.session_socket_name = SESSION_SOCKET
        # Stats says the pool is shared, by whom (pods with a live client registered here)
        servicer.placement = "node"
        servicer.registered_clients = set()
        servicer.shared = functools.partial(self._fill_shared, tp, servicer)
        server = new_server()
        add_servicer(servicer, server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        mode = self._socket_mode(b)
        frames = PodFramedSessions(
            servicer,
            Path(b.target_path) / SESSION_SOCKET,
            MAX_MESSAGE_BYTES,
            self.options.max_sessions,
            directory=b.target_path,
            mode=mode,
            group=b.mount_group,
            admit=functools.partial(self._admit, b) if self._attest is not None else None,
        )
        front = self._front(b, server)
        try:
            await frames.start()
            await server.start()
            front.start()
        except BaseException:
            await server.stop(None)
            await frames.stop(0)
            raise
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        return PodServer(b, server, servicer, health_servicer, frames, front)

    @staticmethod
    async def _stop_pod(pod: PodServer, grace: float) -> None:
        pod.front.stop()  # no new connection; those open finish their calls within the grace
        try:
            await pod.health.enter_graceful_shutdown()
            await asyncio.gather(pod.server.stop(grace), pod.frames.stop(grace))
        finally:
            pod.front.close_all()

    # -- life --------------------------------------------------------------------------------

    def _call(self, coro: Any) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(_CALL_TIMEOUT_S)

    def close(self) -> None:
        """Stop every pod server and every Pool (the memfds stay: the holder keeps them, and a
        new agent adopts their indexes)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            tenants = list(self._tenants.values())
            refusing = list(self._refusing.values())
            self._tenants.clear()
            self._pods.clear()
            self._refusing.clear()
            self._waiting.clear()
        for r in refusing:
            with contextlib.suppress(Exception):
                self._call(self._stop_refusing(r))
        for tp in tenants:
            tp.pool.begin_drain()
            for pod in list(tp.pods.values()):
                with contextlib.suppress(Exception):
                    self._call(self._stop_pod(pod, self.options.unpublish_grace_s))
            tp.pods.clear()
            if tp.reaper is not None:
                self._loop.call_soon_threadsafe(tp.reaper.cancel)
            tp.pool.close()
        if self._outsider is not None:
            with contextlib.suppress(Exception):
                self._call(self._outsider.stop(0))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._loop.is_running():
            self._loop.close()
