"""The gRPC face of the Pool: a thin `PoolServicer`, health, and the server's life cycle.

Every KVPool call decodes its request, calls one `Pool` method, and encodes the answer; domain
errors become status codes through `ERROR_CODES` (one table). The same per-method handlers serve
unary calls and the `Session` stream, where errors come back in-stream as `SessionError`.

The server is `grpc.aio`: Pool methods are short and take the Pool's own lock, so they run on the
event loop directly (no thread hop). `create_server` builds and binds; `SidecarServer.start` /
`drain` run it, so tests can bind a Unix socket in a temporary directory.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from kvoffload.v1 import pool_pb2 as pb
from kvoffload.v1 import pool_pb2_grpc as pb_grpc

from kvoffload_sidecar import convert, filemode
from kvoffload_sidecar.config import SidecarConfig, remove_stale_socket
from kvoffload_sidecar.connector_status import read_connector_status
from kvoffload_sidecar.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PoolError,
    ResourceExhausted,
    Unavailable,
)
from kvoffload_sidecar.frames import FramedSessions, socket_path_for
from kvoffload_sidecar.metrics import SidecarMetrics, package_version
from kvoffload_sidecar.pool import Pool
from kvoffload_sidecar.presence import PresenceMap

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVPool"].full_name  # "kvoffload.v1.KVPool"
MAX_MESSAGE_BYTES = 32 << 20  # 65,536 keys of 256 bytes fit with room to spare
DRAIN_POLL_S = 0.05  # how often drain checks whether the open sessions have ended
FINAL_GRACE_S = 0.5  # in-flight unary calls once no session is left (they take microseconds)

# The one table: domain error -> status code. Anything else is a bug: logged, answered INTERNAL.
ERROR_CODES: dict[type[PoolError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
}


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(code, message) for an exception raised by a handler; logs the unexpected ones."""
    for cls in type(exc).__mro__:
        code = ERROR_CODES.get(cls)  # type: ignore[call-overload]
        if code is not None:
            return code, str(exc)
    log.exception("unexpected error in a KVPool call", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class Malformed:
    """What the request deserializer yields for bytes that do not parse (-> INVALID_ARGUMENT)."""

    message_type: str
    error: str

    def reason(self) -> str:
        return f"request is not a valid {self.message_type}: {self.error}"


def _safe_deserializer(message_type: Any) -> Callable[[bytes], Any]:
    """grpc answers UNKNOWN when a deserializer raises; this lets us answer INVALID_ARGUMENT."""
    from_string = message_type.FromString

    def deserialize(data: bytes) -> Any:
        try:
            return from_string(data)
        except DecodeError as exc:
            return Malformed(message_type.DESCRIPTOR.full_name, str(exc))

    return deserialize


_parse_session_request = _safe_deserializer(pb.SessionRequest)


def add_servicer(servicer: pb_grpc.KVPoolServicer, server: grpc.aio.Server) -> None:
    """Like the generated `add_KVPoolServicer_to_server`, with undecodable requests tolerated."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in pb.DESCRIPTOR.services_by_name["KVPool"].methods:
        request_type = getattr(pb, method.input_type.name)
        response_type = getattr(pb, method.output_type.name)
        make = (
            grpc.stream_stream_rpc_method_handler
            if method.client_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=_safe_deserializer(request_type),
            response_serializer=response_type.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


# A handler fills `out` from `request`; `session_client` is the attached client inside a Session
# stream (0 for unary calls), used when a request leaves client_id at 0.
Handler = Callable[[Any, int, Any], None]


def _client(request_client: int, session_client: int) -> int:
    if session_client and request_client not in (0, session_client):
        raise InvalidArgument(
            f"client_id {request_client} differs from this session's client {session_client}"
        )
    return convert.require_id(request_client or session_client, "client_id")


class PoolServicer(pb_grpc.KVPoolServicer):
    """KVPool over one `Pool`: decode -> Pool -> encode, with timing and the error table."""

    def __init__(self, pool: Pool, metrics: SidecarMetrics) -> None:
        self._pool = pool
        self._metrics = metrics
        self._tenants = pool.settings.tenants is not None  # decode cache salts only then
        self._version = package_version()
        # Session oneof name -> (metric name, handler); the response oneof has the same name.
        self._session_calls: dict[str, tuple[str, Handler]] = {
            "lookup": ("Session/Lookup", self._lookup),
            "reserve_load": ("Session/ReserveLoad", self._reserve_load),
            "release": ("Session/Release", self._release),
            "reserve_store": ("Session/ReserveStore", self._reserve_store),
            "commit_store": ("Session/CommitStore", self._commit_store),
            "abort_store": ("Session/AbortStore", self._abort_store),
            "drained": ("Session/Drained", self._drained),
        }
        self.open_sessions = 0  # gRPC Session streams and framed connections
        self._sessions_lock = threading.Lock()  # framed connections open and close in threads
        self.session_socket_name = ""  # the framed socket's file name, told to registrants
        self.presence_map_name = ""  # the presence map's file name (presence.py), likewise
        self.tenant_memory = ""  # node mode: the tenant whose memfd holds the regions
        self._session_tasks: set[asyncio.Task[Any]] = set()  # open gRPC Session handlers
        self._ending: set[asyncio.Task[Any]] = set()  # of those, cancelled by cancel_sessions
        self.status_dir: Path | None = None  # where connectors write their status files
        self.placement = "pod"  # Stats: "node" where a node agent's pods share the pool
        # node placement: fills Stats' SharedPool (the agent's pools.py); None in pod mode
        self.shared: Callable[[pb.SharedPool], None] | None = None
        # node placement: ids of the clients registered through this server (one pod's), so
        # the agent can tell which pods have a live client; None: not kept (pod mode)
        self.registered_clients: set[int] | None = None

    # -- handlers: one per method, shared by unary calls and the Session stream ------------------

    def _register(self, req: pb.RegisterRequest, _session: int, out: pb.RegisterResponse) -> None:
        spec, num_ranks, slot_bytes, name, engine = convert.register_args(req)
        reg = self._pool.register(spec, num_ranks, slot_bytes, name, engine)
        convert.registration_to_proto(reg, out)
        out.session_socket = self.session_socket_name
        out.presence_map = self.presence_map_name
        out.tenant_memory = self.tenant_memory
        self._pool_name(reg.pool_generation, out.pool)
        if self.registered_clients is not None:
            self.registered_clients.add(reg.client_id)

    def _pool_name(self, generation: str, out: pb.PoolName) -> None:
        """Which pool this is, for each replica's /metrics: a node agent's tenant pool by its
        SharedPool's id, a sidecar's by its pod (the host name) and its generation."""
        out.placement = self.placement
        if self.shared is None:
            out.pool_id = f"{socket.gethostname()}/{generation}"
            out.pool_bytes = self._pool.settings.pool_size
            return
        shared = pb.SharedPool()
        self.shared(shared)
        out.pool_id = shared.pool_id
        out.node_pool = shared.node_pool
        out.node = shared.node
        out.tenant = shared.tenant
        out.pool_bytes = shared.capacity_bytes

    def _lookup(self, req: pb.LookupRequest, _session: int, out: pb.LookupResponse) -> None:
        ns = convert.require_namespace(req.namespace_id)
        salts = [q.cache_salt for q in req.queries] if self._tenants else None
        queries = [q.keys for q in req.queries]
        if req.report_misses:
            out.hit_counts.extend(self._pool.count_misses(ns, queries, salts))
        else:
            out.hit_counts.extend(self._pool.lookup(ns, queries, salts))

    def _reserve_load(
        self, req: pb.ReserveLoadRequest, session: int, out: pb.ReserveLoadResponse
    ) -> None:
        ns = convert.require_namespace(req.namespace_id)
        client = _client(req.client_id, session)
        pin = self._pool.reserve_load(
            ns, client, req.keys, count_lookup=req.count_lookup, cache_salt=req.cache_salt
        )
        convert.load_pin_to_proto(pin, out)
        self._metrics.transfers.pinned(ns, pin.pin_id)

    def _release(self, req: pb.ReleaseRequest, session: int, out: pb.ReleaseResponse) -> None:
        ns = convert.require_namespace(req.namespace_id)
        out.released_slots = self._pool.release(ns, _client(req.client_id, session), req.pin_ids)
        self._metrics.transfers.released(ns, req.pin_ids)

    def _reserve_store(
        self, req: pb.ReserveStoreRequest, session: int, out: pb.ReserveStoreResponse
    ) -> None:
        ns = convert.require_namespace(req.namespace_id)
        salts = convert.key_salts(req) if self._tenants else None
        res = self._pool.reserve_store(
            ns, _client(req.client_id, session), req.keys, req.announce, salts
        )
        convert.store_reservation_to_proto(res, out)
        self._metrics.transfers.store_reserved(ns, res.store_id)

    def _commit_store(
        self, req: pb.CommitStoreRequest, _session: int, out: pb.CommitStoreResponse
    ) -> None:
        ns = convert.require_namespace(req.namespace_id)
        out.visible = self._pool.commit_store(
            ns,
            convert.require_id(req.store_id, "store_id"),
            req.rank,
            epoch=req.sidecar_epoch,
            engine=req.engine,
        )
        if out.visible:
            self._metrics.transfers.store_visible(ns, req.store_id)

    def _abort_store(
        self, req: pb.AbortStoreRequest, _session: int, out: pb.AbortStoreResponse
    ) -> None:
        ns = convert.require_namespace(req.namespace_id)
        out.freed_slots = self._pool.abort_store(
            ns,
            convert.require_id(req.store_id, "store_id"),
            epoch=req.sidecar_epoch,
            engine=req.engine,
        )
        self._metrics.transfers.store_aborted(ns, req.store_id)

    def _drained(self, req: pb.DrainedRequest, session: int, out: pb.DrainedResponse) -> None:
        ns = convert.require_namespace(req.namespace_id)
        out.freed_slots = self._pool.report_drained(
            ns,
            _client(req.client_id, session),
            epoch=req.sidecar_epoch,
            engine=req.engine,
            rank=req.rank,
        )

    def _events(self, req: pb.EventsRequest, _session: int, out: pb.EventsResponse) -> None:
        ns = convert.require_namespace(req.namespace_id)
        page = self._pool.events(
            ns, req.log_id, req.after_seq, req.cursor, min(req.max_events or 1024, 65536)
        )
        convert.event_page_to_proto(page, out)

    def _stats(self, _req: pb.StatsRequest, _session: int, out: pb.StatsResponse) -> None:
        convert.stats_to_proto(
            self._pool.stats(), self._metrics.latency.snapshot(), self._version, out
        )
        out.connector_status = read_connector_status(self.status_dir)
        out.placement = self.placement
        if self.shared is not None:
            self.shared(out.shared)

    # -- unary RPCs ------------------------------------------------------------------------------

    async def _unary(
        self, method: str, handler: Handler, request: Any, out: Any, context: Any
    ) -> Any:
        start = perf_counter()
        try:
            if type(request) is Malformed:
                raise InvalidArgument(request.reason())
            handler(request, 0, out)
        except Exception as exc:  # noqa: BLE001 - mapped by the table, unexpected ones logged
            code, message = status_of(exc)
        else:
            self._metrics.observe(method, perf_counter() - start)
            # bookkeeping the answer does not need (policy touches): on the loop's next turn,
            # once grpc has taken the answer to send
            asyncio.get_running_loop().call_soon(self._pool.flush_deferred)
            return out
        self._metrics.observe(method, perf_counter() - start)
        await context.abort(code, message)

    async def Register(self, request: pb.RegisterRequest, context: Any) -> pb.RegisterResponse:
        return await self._unary(
            "Register", self._register, request, pb.RegisterResponse(), context
        )

    async def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        return await self._unary("Lookup", self._lookup, request, pb.LookupResponse(), context)

    async def ReserveLoad(
        self, request: pb.ReserveLoadRequest, context: Any
    ) -> pb.ReserveLoadResponse:
        return await self._unary(
            "ReserveLoad", self._reserve_load, request, pb.ReserveLoadResponse(), context
        )

    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseResponse:
        return await self._unary("Release", self._release, request, pb.ReleaseResponse(), context)

    async def ReserveStore(
        self, request: pb.ReserveStoreRequest, context: Any
    ) -> pb.ReserveStoreResponse:
        return await self._unary(
            "ReserveStore", self._reserve_store, request, pb.ReserveStoreResponse(), context
        )

    async def CommitStore(
        self, request: pb.CommitStoreRequest, context: Any
    ) -> pb.CommitStoreResponse:
        return await self._unary(
            "CommitStore", self._commit_store, request, pb.CommitStoreResponse(), context
        )

    async def AbortStore(
        self, request: pb.AbortStoreRequest, context: Any
    ) -> pb.AbortStoreResponse:
        return await self._unary(
            "AbortStore", self._abort_store, request, pb.AbortStoreResponse(), context
        )

    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        return await self._unary("Stats", self._stats, request, pb.StatsResponse(), context)

    async def Events(self, request: pb.EventsRequest, context: Any) -> pb.EventsResponse:
        return await self._unary("Events", self._events, request, pb.EventsResponse(), context)

    # -- the Session stream ----------------------------------------------------------------------

    async def Session(self, request_iterator: Any, context: Any) -> None:
        """attach first, then calls answered in order; `pool.detach` however the stream ends."""
        del request_iterator  # read with context.read(), so the handler is a plain coroutine
        client_id = 0
        self.session_opened()
        task = asyncio.current_task()
        if task is not None:
            self._session_tasks.add(task)
        try:
            first = await context.read()
            if first is grpc.aio.EOF:
                return
            client_id, reply = self.attach_session(first)
            await context.write(reply)  # client_id is set first: a failed write still detaches
            if not client_id:
                return  # the error went back in-stream; the stream ends
            call, flush = self.session_call, self.flush_deferred
            while True:
                request = await context.read()
                if request is grpc.aio.EOF:
                    return
                await context.write(call(request, client_id))
                flush()  # bookkeeping the answer did not need (policy touches), after sending
        except asyncio.CancelledError:
            if task not in self._ending:
                raise
            # `cancel_sessions`: a cancelled handler alone leaves the stream open; end it
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the pool was rebuilt: register")
        finally:
            self._ending.discard(task)
            self._session_tasks.discard(task)
            self.session_closed()
            self.end_session(client_id)

    def cancel_sessions(self) -> int:
        """End every open gRPC Session stream (the pool was rebuilt: its clients are gone);
        the connectors see the stream end and register again. Returns how many."""
        tasks = list(self._session_tasks)
        for task in tasks:
            self._ending.add(task)
            task.cancel()
        return len(tasks)

    # -- the session protocol, shared by the gRPC stream and the framed socket (frames.py) -------

    def parse_session_request(self, data: bytes) -> Any:
        """A SessionRequest, or `Malformed` (answered INVALID_ARGUMENT by `session_call`)."""
        return _parse_session_request(data)

    def flush_deferred(self) -> None:
        self._pool.flush_deferred()

    def session_opened(self) -> None:
        with self._sessions_lock:
            self.open_sessions += 1

    def session_closed(self) -> None:
        with self._sessions_lock:
            self.open_sessions -= 1

    def end_session(self, client_id: int) -> None:
        """The session's transport ended: its client detaches (pins kept for the grace)."""
        if not client_id:
            return
        try:
            self._pool.detach(client_id)
            log.debug("session of client %d ended: pins released", client_id)
        except NotFound:
            pass  # already reaped or detached
        except Exception:  # noqa: BLE001 - never let cleanup kill the server
            log.exception("detaching client %d failed", client_id)

    def attach_session(self, first: pb.SessionRequest) -> tuple[int, pb.SessionResponse]:
        """(attached client id, reply), or (0, error reply) when the first message is no attach."""
        reply = pb.SessionResponse(seq=getattr(first, "seq", 0))
        start = perf_counter()
        try:
            if type(first) is Malformed:
                raise InvalidArgument(first.reason())
            if first.WhichOneof("call") != "attach":
                raise InvalidArgument(
                    f"the first message of a session must be attach, got {first.WhichOneof('call')}"
                )
            client_id = convert.require_id(first.attach.client_id, "attach.client_id")
            self._pool.attach(client_id)
        except Exception as exc:  # noqa: BLE001
            code, message = status_of(exc)
            reply.error.code = code.value[0]
            reply.error.message = message
            return 0, reply
        finally:
            self._metrics.observe("Session/Attach", perf_counter() - start)
        reply.attach.SetInParent()
        return client_id, reply

    def session_call(self, request: pb.SessionRequest, client_id: int) -> pb.SessionResponse:
        """One in-session call answered; errors come back as a `SessionError`, never raised."""
        malformed = type(request) is Malformed
        reply = pb.SessionResponse(seq=0 if malformed else request.seq)
        kind = None if malformed else request.WhichOneof("call")
        entry = self._session_calls.get(kind) if kind else None
        start = perf_counter()
        try:
            if malformed:
                raise InvalidArgument(request.reason())
            if entry is None:
                raise (
                    FailedPrecondition("this session is already attached")
                    if kind == "attach"
                    else InvalidArgument("session request has no call set")
                )
            out = getattr(reply, kind)  # type: ignore[arg-type]
            out.SetInParent()
            entry[1](getattr(request, kind), client_id, out)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001
            code, message = status_of(exc)
            reply.ClearField("result")
            reply.error.code = code.value[0]
            reply.error.message = message
        self._metrics.observe(entry[0] if entry else "Session/Invalid", perf_counter() - start)
        return reply


class StatsOnlyServicer(pb_grpc.KVPoolServicer):
    """KVPool for the TCP listener: Stats only; every other method answers UNIMPLEMENTED."""

    def __init__(self, servicer: PoolServicer) -> None:
        self._servicer = servicer

    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        return await self._servicer.Stats(request, context)


def new_server() -> grpc.aio.Server:
    return grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ]
    )


@dataclass
class SidecarServer:
    """A built, bound server: start it, later drain it. Owns no Pool life cycle but `drain`."""

    server: grpc.aio.Server
    pool: Pool
    servicer: PoolServicer
    health: health.aio.HealthServicer
    metrics: SidecarMetrics
    socket_target: str
    tcp_server: grpc.aio.Server | None = None
    tcp_port: int | None = None
    frames: FramedSessions | None = None
    _stopped: bool = field(default=False, repr=False)

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def start(self) -> None:
        """Start serving; health turns SERVING once the socket accepts calls."""
        if self.frames is not None:  # before gRPC: every Register answer names it
            await self.frames.start()
            self.servicer.session_socket_name = self.frames.path.name
        await self.server.start()
        if self.tcp_server is not None:
            await self.tcp_server.start()
        await self.set_serving(True)

    async def end_sessions(self) -> None:
        """End every open session, gRPC and framed (after the pool was rebuilt)."""
        ended = self.servicer.cancel_sessions()
        if self.frames is not None:
            ended += self.frames.close_all()
        if ended:
            log.info("ended %d session(s): their connectors register again", ended)

    async def drain(self, grace: float) -> None:
        """NOT_SERVING, refuse new reservations, give open stores up to `grace` s, then stop.

        Calls keep being answered meanwhile (reads, commits, releases; reservations answer
        UNAVAILABLE); the server stops as soon as no session is open or no store is left to
        commit: the pool file stays, and the next sidecar adopts what was committed, so a
        restart or an image upgrade waits only for the copies in flight, not for vLLM to go.
        """
        if self._stopped:
            return
        self._stopped = True
        await self.health.enter_graceful_shutdown()
        self.pool.begin_drain()
        deadline = asyncio.get_running_loop().time() + grace
        while (
            self.servicer.open_sessions
            and self.pool.open_stores()
            and asyncio.get_running_loop().time() < deadline
        ):
            await asyncio.sleep(DRAIN_POLL_S)
        stops = [self.server.stop(FINAL_GRACE_S)]
        if self.frames is not None:
            stops.append(self.frames.stop(FINAL_GRACE_S))
        if self.tcp_server is not None:
            stops.append(self.tcp_server.stop(FINAL_GRACE_S))
        await asyncio.gather(*stops)


def bind_unix(server: grpc.aio.Server, sock: Path) -> str:
    """Bind `server` to the Unix socket `sock` (absolute), at `filemode.file_mode()` before it
    serves (0600 by default; 0666 in pods, where vLLM may run as any uid and the run dir is a
    pod-private emptyDir). The gRPC target."""
    target = f"unix:{sock}"
    server.add_insecure_port(target)  # binds (and listens) here; start() only begins serving
    os.chmod(sock, filemode.file_mode())
    return target


def create_server(
    config: SidecarConfig, pool: Pool, *, metrics: SidecarMetrics | None = None
) -> SidecarServer:
    """Build the KVPool + health server bound to `config.socket` (and `config.listen` over TCP).

    Must be called with a running event loop. A stale socket file is replaced; a live one is an
    error (raised by grpc as RuntimeError when binding fails).
    """
    metrics = metrics or SidecarMetrics(pool)
    servicer = PoolServicer(pool, metrics)
    health_servicer = health.aio.HealthServicer()
    server = new_server()
    add_servicer(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    tcp: grpc.aio.Server | None = None
    tcp_port: int | None = None
    if config.listen:  # first: a port that cannot be bound leaves no Unix socket bound behind
        tcp = new_server()
        add_servicer(StatsOnlyServicer(servicer), tcp)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, tcp)
        tcp_port = tcp.add_insecure_port(config.listen)
    sock = config.socket.absolute()
    remove_stale_socket(sock)
    target = bind_unix(server, sock)
    servicer.status_dir = metrics.status_dir = sock.parent
    built = SidecarServer(server, pool, servicer, health_servicer, metrics, target, tcp, tcp_port)
    if config.framed_sessions:
        built.frames = FramedSessions(
            servicer, socket_path_for(sock), MAX_MESSAGE_BYTES, config.max_sessions
        )
    if config.presence_map:
        servicer.presence_map_name = attach_presence(pool, sock.with_name(sock.name + ".presence"))
    return built


def attach_presence(pool: Pool, path: Path) -> str:
    """The presence map beside the socket, kept by `pool`; its file name, or "" (logged) when
    it cannot be written: connectors then look every request up, as without it."""
    try:
        presence = PresenceMap(path)
    except OSError as e:
        log.warning("no presence map at %s (%s): connectors look every request up", path, e)
        return ""
    pool.attach_presence(presence)
    return path.name
