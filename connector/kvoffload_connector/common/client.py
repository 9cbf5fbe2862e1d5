"""gRPC client of the sidecar on its Unix socket (no torch).

Contract for callers: every method either returns the answer within its
deadline or raises `PoolUnavailable`; callers treat that as a cache miss (or a
dropped store) and carry on. After `register` the client keeps one channel and
one `Session` stream open (the stream owns this client's pins and
reservations: if this process dies the sidecar releases them). When the
stream breaks, or the sidecar stays silent past a call's deadline (the client
then drops the stream itself), `ensure()` re-registers with the same arguments, at most once
per backoff period (doubling from `reconnect_min` to `reconnect_max`), on a
fresh channel so gRPC's own reconnect backoff never delays recovery.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import grpc
from kvoffload.v1 import pool_pb2, pool_pb2_grpc

from kvoffload_connector.common.backoff import Backoff
from kvoffload_connector.common.errors import PoolUnavailable
from kvoffload_connector.common.framed import FramedSession
from kvoffload_connector.common.grpc_session import GrpcSession
from kvoffload_connector.common.keys import SpecFields, pack
from kvoffload_connector.common.pool_replies import (
    Pinned,
    RankRegion,
    RegisterResult,
    StoreReservation,
    key_salts,
    no_salts,
    slots_of,
    versions_of,
)
from kvoffload_connector.common.presence import PresenceView, open_presence
from kvoffload_connector.common.rpc_thread import RpcThread

if TYPE_CHECKING:
    from kvoffload_connector.common.config import ConnectorConfig

__all__ = [
    "REGISTER_TIMEOUT_S",
    "Backoff",
    "Pinned",
    "PoolClient",
    "PoolUnavailable",
    "RankRegion",
    "RegisterResult",
    "RpcThread",
    "StoreReservation",
    "key_salts",
]

log = logging.getLogger(__name__)


# Register runs once per (re)connection and never on a step: give a busy sidecar time.
REGISTER_TIMEOUT_S = 5.0


class PoolClient:
    """Thread-safe client of one sidecar socket for one engine process."""

    def __init__(
        self,
        socket_path: str,
        client_name: str,
        *,
        rpc_timeout_s: float = 1.0,
        reconnect_min_s: float = 0.1,
        reconnect_max_s: float = 0.5,
        framed: bool = True,
        keep_attached: bool = False,
        engine: int = 0,
    ):
        self.socket_path = socket_path
        self.engine = engine  # the vLLM instance this process belongs to (RegisterRequest)
        self.framed = framed  # use the sidecar's framed socket for the session when offered
        self.transport = ""  # "framed" or "grpc": what the live session runs on
        # the sidecar's presence map (presence.py) from the last registration, or None
        self.presence: PresenceView | None = None
        self.client_name = client_name
        self.rpc_timeout_s = rpc_timeout_s
        self.backoff = Backoff(reconnect_min_s, reconnect_max_s)
        self._lock = threading.RLock()
        self._channel: grpc.Channel | None = None
        self._stub: pool_pb2_grpc.KVPoolStub | None = None
        self._session: GrpcSession | FramedSession | None = None
        self._register_args: tuple[SpecFields, int, int] | None = None
        self.registration: RegisterResult | None = None
        self.key_size = 0
        self.registrations = 0  # successful (re-)registrations, for tests and logs
        self._socket_id: tuple[int, int] | None = None  # (dev, inode) of the socket registered on
        self._closed = threading.Event()
        self._keeper: threading.Thread | None = None
        self._keep_attached = keep_attached
        # Called with each answer before it becomes `registration`, on the registering thread:
        # PoolUnavailable from it fails that registration (a worker that cannot map the memory
        # the answer names). `last_error`: why the last registration failed ("" once one held).
        self.accept: Callable[[RegisterResult], None] | None = None
        self.last_error = ""

    @classmethod
    def from_config(cls, cfg: ConnectorConfig, client_name: str) -> PoolClient:
        """The client a connector half uses: socket, deadlines and transport from its config."""
        return cls(
            cfg.socket,
            client_name,
            rpc_timeout_s=cfg.rpc_timeout_ms / 1e3,
            reconnect_min_s=cfg.reconnect_min_ms / 1e3,
            reconnect_max_s=cfg.reconnect_max_ms / 1e3,
            framed=cfg.framed_session,
            keep_attached=True,
        )

    # -- connection -----------------------------------------------------------------
    def _open(self) -> pool_pb2_grpc.KVPoolStub:
        self._close_channel()
        self._channel = grpc.insecure_channel(
            f"unix://{self.socket_path}",
            options=[
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
                ("grpc.enable_http_proxy", 0),
            ],
        )
        self._stub = pool_pb2_grpc.KVPoolStub(self._channel)
        return self._stub

    def _close_channel(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def register(
        self, spec: SpecFields, num_ranks: int, slot_bytes_per_rank: int
    ) -> RegisterResult:
        """Register (or re-register) and open the session; raises PoolUnavailable."""
        with self._lock:
            self._register_args = (spec, num_ranks, slot_bytes_per_rank)
            self._start_keeper()
            return self._register()

    def remember(self, spec: SpecFields, num_ranks: int, slot_bytes_per_rank: int) -> None:
        """Set what `ensure()` re-registers with, without registering now."""
        with self._lock:
            self._register_args = (spec, num_ranks, slot_bytes_per_rank)
            self.key_size = spec.key_size
            self._start_keeper()

    # -- staying attached -------------------------------------------------------------
    KEEPER_PERIOD_S = 0.2  # while away: how often it tries to register again
    # While attached it sleeps on the session's `ended` (a hang-up or close wakes it at once)
    # and wakes on its own only this rarely, to see whether another process bound the socket:
    # every timer wake takes the engine's GIL, and a launch thread that hands it over
    # mid-prefill is one more chance for the host to slow it (docs/BENCHMARKS.md).
    KEEPER_ATTACHED_CHECK_S = 2.0

    def _start_keeper(self) -> None:
        """Lock held: with `keep_attached`, a daemon thread re-registers on its own when the
        sidecar comes back (restart, upgrade), so an idle engine's next request already finds
        the pool instead of missing while the first step reconnects."""
        if self._keep_attached and self._keeper is None and not self._closed.is_set():
            self._keeper = threading.Thread(
                target=self._keep, name="kvoffload-keep-attached", daemon=True
            )
            self._keeper.start()

    def _keep(self) -> None:
        while not self._closed.is_set():
            session = self._session
            if session is not None and self.connected:
                session.ended.wait(self.KEEPER_ATTACHED_CHECK_S)
            else:
                self._closed.wait(self.KEEPER_PERIOD_S)
            if self._closed.is_set():
                return
            try:
                if self.connected:
                    if self._socket_id is None or self._socket_now() == self._socket_id:
                        continue
                    # Another process bound the socket: this session talks to a dead sidecar
                    # (an idle session does not notice by itself).
                    with self._lock:
                        if self.connected and self._socket_now() != self._socket_id:
                            log.info("kvoffload: the sidecar at %s restarted", self.socket_path)
                            self._close_channel()
                self.ensure()
            except Exception:  # noqa: BLE001 - the keeper must never die of one bad turn
                log.debug("kvoffload: keep-attached turn failed", exc_info=True)

    def _socket_now(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.socket_path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino)

    def _register(self) -> RegisterResult:
        assert self._register_args is not None
        spec = self._register_args[0]
        stub = self._open()
        socket_id = self._socket_now()
        try:
            resp = stub.Register(
                self._register_request(), timeout=max(self.rpc_timeout_s, REGISTER_TIMEOUT_S)
            )
            result = RegisterResult.from_response(resp)
            if self.accept is not None:
                self.accept(result)
            self._session = self._open_session(stub, resp)
        except (grpc.RpcError, PoolUnavailable) as e:
            self._close_channel()
            self.registration = None
            self.backoff.failed()
            if isinstance(e, PoolUnavailable):
                self.last_error = str(e)
                raise
            self.last_error = f"register: {e.code()}: {e.details()}"
            raise PoolUnavailable(self.last_error) from None
        self.backoff.reset()
        self.last_error = ""
        self._socket_id = socket_id
        self.key_size = spec.key_size
        # each registration names its sidecar's map: a restarted one writes a new file
        self.presence = open_presence(self.socket_path, resp.presence_map)
        self.registrations += 1
        self.registration = result
        return self.registration

    def _register_request(self) -> pool_pb2.RegisterRequest:
        """The `Register` call for the remembered layout (every transport sends this one)."""
        assert self._register_args is not None
        spec, num_ranks, slot_bytes = self._register_args
        return pool_pb2.RegisterRequest(
            spec=spec.to_proto(),
            num_ranks=num_ranks,
            slot_bytes_per_rank=slot_bytes,
            client_name=self.client_name,
            engine=self.engine,
        )

    def _open_session(
        self, stub: pool_pb2_grpc.KVPoolStub, resp: pool_pb2.RegisterResponse
    ) -> GrpcSession | FramedSession:
        """The framed socket when the sidecar offers it (and `framed`), else the gRPC stream."""
        timeout_s = max(self.rpc_timeout_s, REGISTER_TIMEOUT_S)
        name = resp.session_socket
        if self.framed and name:
            if os.path.basename(name) != name or name in (".", ".."):
                log.warning("kvoffload: ignoring session socket %r (not a file name)", name)
            else:
                path = os.path.join(os.path.dirname(self.socket_path), name)
                try:
                    session = FramedSession(path, resp.client_id, timeout_s)
                    self.transport = "framed"
                    return session
                except PoolUnavailable as e:
                    log.info("kvoffload: framed session unavailable (%s): using gRPC", e)
        session = GrpcSession(stub, resp.client_id, timeout_s)
        self.transport = "grpc"
        return session

    @property
    def connected(self) -> bool:
        s = self._session
        return self.registration is not None and s is not None and s.alive

    def ensure(self) -> bool:
        """True when registered with a live session; re-registers when due. Never raises."""
        if self.connected:
            return True
        with self._lock:
            if self.connected:
                return True
            if self._register_args is None or not self.backoff.due():
                return False
            try:
                self._register()
                log.info(
                    "kvoffload: registered with %s (generation %s)",
                    self.socket_path,
                    self.registration.generation if self.registration else "?",
                )
                return True
            except PoolUnavailable as e:
                log.debug("kvoffload: sidecar still away: %s", e)
                return False

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            self._close_channel()
            self.registration = None

    # -- calls ----------------------------------------------------------------------
    def _call(self, timeout_s: float | None, **call) -> pool_pb2.SessionResponse:
        session, reg = self._session, self.registration
        if session is None or reg is None or not session.alive:
            raise PoolUnavailable("not connected")
        return session.call(self.rpc_timeout_s if timeout_s is None else timeout_s, **call)

    def _ns(self) -> tuple[str, int]:
        reg = self.registration
        if reg is None:
            raise PoolUnavailable("not registered")
        return reg.namespace_id, reg.client_id

    def lookup(
        self,
        queries: Sequence[Sequence[bytes]],
        timeout_s: float | None = None,
        salts: Sequence[str | None] | None = None,
        report_misses: bool = False,
    ) -> list[int]:
        """Longest committed prefix (in keys) of each key list; `salts`: per list, its
        request's cache_salt (the sidecar counts it for that tenant). `report_misses`: the
        lists were answered as misses already (the presence map): only counted, never looked
        up (a sidecar older than the field looks them up)."""
        ns, _ = self._ns()
        req = pool_pb2.LookupRequest(
            namespace_id=ns,
            queries=[
                pool_pb2.KeyList(keys=pack(q, self.key_size), cache_salt=salt or "")
                for q, salt in zip(queries, salts or no_salts(len(queries)), strict=True)
            ],
            report_misses=report_misses,
        )
        return list(self._call(timeout_s, lookup=req).lookup.hit_counts)

    def reserve_load(self, keys: Sequence[bytes]) -> Pinned:
        """Pin the longest committed prefix of `keys`: (pin id or 0, its slots, versions)."""
        ns, cid = self._ns()
        r = self._call(
            None,
            reserve_load=pool_pb2.ReserveLoadRequest(
                namespace_id=ns, client_id=cid, keys=pack(keys, self.key_size)
            ),
        ).reserve_load
        slots = slots_of(r.slots)
        return Pinned(r.pin_id, slots, versions_of(r.versions, len(slots)))

    def reserve_load_many(
        self,
        key_lists: Sequence[Sequence[bytes]],
        *,
        count_lookup: bool = False,
        timeout_s: float | None = None,
        salts: Sequence[str | None] | None = None,
    ) -> list[Pinned | None]:
        """`reserve_load` for each key list, pipelined on the session: (pin id or 0, slots,
        versions) per list, None where that call failed (a miss). `count_lookup`: the sidecar
        also counts each as a lookup (a lookup and its pin in one round trip), for the tenant
        of the list's cache salt in `salts`."""
        ns, cid = self._ns()
        session = self._session
        if session is None or not session.alive:
            raise PoolUnavailable("not connected")
        calls = [
            {
                "reserve_load": pool_pb2.ReserveLoadRequest(
                    namespace_id=ns,
                    client_id=cid,
                    keys=pack(keys, self.key_size),
                    count_lookup=count_lookup,
                    cache_salt=salt or "",
                )
            }
            for keys, salt in zip(key_lists, salts or no_salts(len(key_lists)), strict=True)
        ]
        out: list[Pinned | None] = []
        deadline = self.rpc_timeout_s if timeout_s is None else timeout_s
        for r in session.call_many(deadline, calls):
            if isinstance(r, PoolUnavailable):
                out.append(None)
            else:
                slots = slots_of(r.reserve_load.slots)
                versions = versions_of(r.reserve_load.versions, len(slots))
                out.append(Pinned(r.reserve_load.pin_id, slots, versions))
        return out

    def release(self, pin_ids: Sequence[int]) -> int:
        ns, cid = self._ns()
        return self._call(
            None,
            release=pool_pb2.ReleaseRequest(namespace_id=ns, client_id=cid, pin_ids=list(pin_ids)),
        ).release.released_slots

    def reserve_store(
        self,
        keys: Sequence[bytes],
        announce: Sequence[bytes] = (),
        salts: Sequence[str | None] = (),
    ) -> StoreReservation:
        """Slots for the keys not in the pool yet; `announce`: per key, what KV events say of
        its block once visible (events.py), or nothing; `salts`: per key, its request's
        cache_salt (the sidecar's per-tenant quotas), or nothing."""
        ns, cid = self._ns()
        request = pool_pb2.ReserveStoreRequest(
            namespace_id=ns, client_id=cid, keys=pack(keys, self.key_size), announce=announce
        )
        if any(salts):
            names, request.key_salts = key_salts(salts)
            request.cache_salts.extend(names)
        r = self._call(None, reserve_store=request).reserve_store
        return StoreReservation(r.store_id, r.decisions, slots_of(r.slots))

    def commit_store(
        self, namespace_id: str, store_id: int, rank: int, *, epoch: int = 0, engine: int = 0
    ) -> bool:
        """`epoch` and `engine`: the sidecar instance that answered the reservation and the
        engine it belongs to (the sidecar refuses a commit naming others; PoolUnavailable)."""
        return self._call(
            None,
            commit_store=pool_pb2.CommitStoreRequest(
                namespace_id=namespace_id,
                store_id=store_id,
                rank=rank,
                sidecar_epoch=epoch,
                engine=engine,
            ),
        ).commit_store.visible

    def abort_store(
        self, namespace_id: str, store_id: int, *, epoch: int = 0, engine: int = 0
    ) -> int:
        return self._call(
            None,
            abort_store=pool_pb2.AbortStoreRequest(
                namespace_id=namespace_id, store_id=store_id, sidecar_epoch=epoch, engine=engine
            ),
        ).abort_store.freed_slots

    def report_drained(self, namespace_id: str, *, epoch: int, engine: int, rank: int) -> int:
        """This rank of `engine` has no copy in flight into a reservation of a sidecar instance
        other than `epoch` (its registration's) and starts none: the withheld slots of the
        engine's earlier reservations free once every rank said so. Returns the slots freed."""
        return self._call(
            None,
            drained=pool_pb2.DrainedRequest(
                namespace_id=namespace_id, sidecar_epoch=epoch, engine=engine, rank=rank
            ),
        ).drained.freed_slots

    def events(
        self, log_id: str, after_seq: int, cursor: int, max_events: int
    ) -> pool_pb2.EventsResponse:
        """The registered namespace's block events after `after_seq` (events.py): gRPC, not
        the session (a background poll, not the engine's step)."""
        ns, _ = self._ns()
        with self._lock:
            stub = self._stub or self._open()
        request = pool_pb2.EventsRequest(
            namespace_id=ns,
            log_id=log_id,
            after_seq=after_seq,
            cursor=cursor,
            max_events=max_events,
        )
        try:
            return stub.Events(request, timeout=self.rpc_timeout_s)
        except grpc.RpcError as e:
            raise PoolUnavailable(f"events: {e.code()}") from None

    def stats(self) -> pool_pb2.StatsResponse:
        with self._lock:
            stub = self._stub or self._open()
        try:
            return stub.Stats(pool_pb2.StatsRequest(), timeout=self.rpc_timeout_s)
        except grpc.RpcError as e:
            raise PoolUnavailable(f"stats: {e.code()}") from None
