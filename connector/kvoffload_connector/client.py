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

import contextlib
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import grpc
from kvoffload.v1 import pool_pb2, pool_pb2_grpc

from kvoffload_connector.errors import PoolUnavailable
from kvoffload_connector.framed import FramedSession
from kvoffload_connector.keys import SpecFields, pack, unpack_slots
from kvoffload_connector.presence import PresenceView, open_presence
from kvoffload_connector.session import OrderedSession

if TYPE_CHECKING:
    from kvoffload_connector.config import ConnectorConfig

log = logging.getLogger(__name__)


# Register runs once per (re)connection and never on a step: give a busy sidecar time.
REGISTER_TIMEOUT_S = 5.0


def _no_salts(n: int) -> Sequence[None]:
    return (None,) * n


def key_salts(salts: Sequence[str | None]) -> tuple[list[str], bytes]:
    """A store batch's per-key salts as the contract packs them: the distinct salts, and per
    key 1 + its salt's index (0: none), one byte per key, two (little-endian) past 255 salts."""
    index: dict[str, int] = {}
    codes = []
    for s in salts:
        if s and (s in index or len(index) < 0xFFFF):
            codes.append(index.setdefault(s, len(index) + 1))
        else:  # no salt, or past the 65,535 salts two bytes name: the default tenant
            codes.append(0)
    if len(index) < 256:
        return list(index), bytes(codes)
    return list(index), b"".join(c.to_bytes(2, "little") for c in codes)


def _slots(packed: bytes) -> list[int]:
    try:
        return unpack_slots(packed)
    except ValueError as e:  # a reply this client cannot read is no answer
        raise PoolUnavailable(f"malformed reply: {e}") from None


def _versions(packed: bytes, n: int) -> list[int]:
    """Slot versions from a ReserveLoad reply (8-byte little-endian uint64s, one per slot);
    a sidecar that sent none (or a malformed list) gives zeros, which no load accepts."""
    if len(packed) != 8 * n:
        return [0] * n
    return list(struct.unpack(f"<{n}Q", packed))


class Pinned(NamedTuple):
    """One ReserveLoad's answer: the pin (0: nothing pinned), its slots and their versions."""

    pin_id: int
    slots: list[int]
    versions: list[int]


@dataclass(frozen=True)
class RankRegion:
    rank: int
    path: str
    offset: int
    slot_bytes: int
    slot_count: int


@dataclass(frozen=True)
class RegisterResult:
    namespace_id: str
    client_id: int
    regions: tuple[RankRegion, ...]
    pool_ready: bool
    committed_blocks: int
    generation: str
    epoch: int = 0  # the sidecar instance's: commits and aborts name it
    engine: int = 0  # the engine this client's reservations belong to
    engine_lock_base: int = 0  # engine_lock.lock_offset(base, engine, rank)
    slot_table_offset: int = 0  # slot i's version: the u64 at offset + i * record_bytes
    slot_record_bytes: int = 0

    @classmethod
    def from_response(cls, resp: pool_pb2.RegisterResponse) -> RegisterResult:
        return cls(
            namespace_id=resp.namespace_id,
            client_id=resp.client_id,
            regions=tuple(
                RankRegion(r.rank, r.path, r.offset, r.slot_bytes, r.slot_count)
                for r in resp.regions
            ),
            pool_ready=resp.pool_ready,
            committed_blocks=resp.committed_blocks,
            generation=resp.pool_generation,
            epoch=resp.sidecar_epoch,
            engine=resp.engine,
            engine_lock_base=resp.engine_lock_base,
            slot_table_offset=resp.slot_table_offset,
            slot_record_bytes=resp.slot_record_bytes,
        )


@dataclass(frozen=True)
class StoreReservation:
    store_id: int  # 0 when nothing is to be written
    decisions: bytes  # per key, one byte: its pool_pb2.StoreDecision value
    slots: list[int]  # one per NEW key, in key order


class Backoff:
    """Doubling retry delay; `due()` says whether a new attempt may start now."""

    def __init__(self, min_s: float, max_s: float, clock: Callable[[], float] = time.monotonic):
        self.min_s, self.max_s, self._clock = min_s, max_s, clock
        self._delay = 0.0
        self._next = 0.0

    def due(self) -> bool:
        return self._clock() >= self._next

    def failed(self) -> None:
        self._delay = self.min_s if self._delay == 0 else min(self.max_s, self._delay * 2)
        self._next = self._clock() + self._delay

    def reset(self) -> None:
        self._delay = 0.0
        self._next = 0.0


class _Session(OrderedSession):
    """One bidirectional `Session` stream, read by the calling thread itself.

    One exchange (a call, or a pipelined batch of calls) holds the stream at a time and its
    caller reads the answers straight off the stream: no reader thread hands them over, which
    saves a thread wake-up per call (8-19 µs at p50, 17-28 µs at p99 on a 2-core VM, measured
    call for call against a reader-thread client). A watchdog thread enforces deadlines: an
    exchange that outlives its deadline cancels the stream (a sidecar silent for a whole
    deadline is treated as gone: the caller gets `PoolUnavailable` and `ensure()` re-registers;
    the sidecar holds the ended session's pins and reservations for its detach grace, so
    copies still in flight cannot race a new owner of those slots).
    """

    # The watchdog wakes every quarter of the shortest deadline seen (at least every 5 ms), so
    # a deadline is honoured within a quarter of itself; each wake takes the GIL from the
    # callers, so it wakes as rarely as that allows (every 50 ms with the default deadlines).
    _MIN_TICK_S = 0.005
    _IDLE_S = 1.0  # no call for this long: the watchdog sleeps until the next one

    def __init__(self, stub: pool_pb2_grpc.KVPoolStub, client_id: int, attach_timeout_s: float):
        super().__init__()
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._closing = False
        self._expired = False
        self._deadline = 0.0  # monotonic deadline of the exchange in flight; 0.0: none
        self._tick_s = max(self._MIN_TICK_S, attach_timeout_s / 4)
        self._last_call = time.monotonic()
        self._wake = threading.Event()  # a call after an idle spell: the watchdog resumes
        self._retick = threading.Event()  # the tick shrank: the watchdog re-plans its sleep
        self._requests.put(
            pool_pb2.SessionRequest(seq=0, attach=pool_pb2.AttachRequest(client_id=client_id))
        )
        self._responses = stub.Session(iter(self._requests.get, None))
        self._responses.add_done_callback(self._on_done)
        self._watchdog = threading.Thread(
            target=self._watch, name="kvoffload-session-watchdog", daemon=True
        )
        self._watchdog.start()
        with self._exchange(attach_timeout_s) as deadline:
            attached = self._answer(0, deadline, attach_timeout_s)
        if attached.WhichOneof("result") == "error":
            self.close()
            raise PoolUnavailable(f"attach refused: {attached.error.message}")

    # -- stream state ---------------------------------------------------------------
    def _on_done(self, _call: object) -> None:
        """The RPC ended (either side, any reason): no call can succeed on it any more."""
        self._mark_ended()
        self._wake.set()  # let the watchdog exit
        self._retick.set()
        if not self._closing and not self._expired:
            log.info("kvoffload: session ended: %s", self._responses.code())

    def _watch(self) -> None:
        while self.alive:
            deadline, now = self._deadline, time.monotonic()
            if deadline and now >= deadline:
                self._expired = True
                log.warning("kvoffload: sidecar silent past a deadline: dropping the session")
                self._responses.cancel()  # the caller's read raises
                return
            if not deadline and now - self._last_call > self._IDLE_S:
                self._wake.clear()
                if not self._deadline and self.alive:  # re-check: a call may have just armed
                    self._wake.wait()
                continue
            self._retick.wait(min(self._tick_s, deadline - now) if deadline else self._tick_s)
            self._retick.clear()

    @contextlib.contextmanager
    def _exchange(self, timeout_s: float) -> Iterator[float]:
        """The base exchange, with its deadline armed in the watchdog."""
        with super()._exchange(timeout_s) as deadline:
            try:
                self._deadline, self._last_call = deadline, time.monotonic()
                if timeout_s < 4 * self._tick_s:
                    self._tick_s = max(self._MIN_TICK_S, timeout_s / 4)
                    self._retick.set()
                if not self._wake.is_set():
                    self._wake.set()
                yield deadline
            finally:
                self._deadline = 0.0

    def _send(self, requests: list[pool_pb2.SessionRequest], deadline: float, timeout_s: float):
        for request in requests:
            self._requests.put(request)

    def _answer(self, seq: int, deadline: float, timeout_s: float) -> pool_pb2.SessionResponse:
        """The answer to `seq`, read off the stream (the watchdog enforces the deadline)."""
        while True:
            try:
                resp = next(self._responses)
            except (grpc.RpcError, StopIteration):
                self._mark_ended()
                if self._expired:
                    raise PoolUnavailable(f"no answer within {timeout_s * 1e3:.0f} ms") from None
                raise PoolUnavailable("session closed") from None
            if resp.seq == seq:
                return resp
            if resp.seq > seq:  # answers come in order: the stream is not what we think
                self.close()
                raise PoolUnavailable(f"answer {resp.seq} arrived before {seq}")

    def close(self) -> None:
        self._closing = True
        self._requests.put(None)
        with contextlib.suppress(Exception):
            self._responses.cancel()
        self._mark_ended()
        self._wake.set()
        self._retick.set()


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
        self._session: _Session | FramedSession | None = None
        self._register_args: tuple[SpecFields, int, int] | None = None
        self.registration: RegisterResult | None = None
        self.key_size = 0
        self.registrations = 0  # successful (re-)registrations, for tests and logs
        self._socket_id: tuple[int, int] | None = None  # (dev, inode) of the socket registered on
        self._closed = threading.Event()
        self._keeper: threading.Thread | None = None
        self._keep_attached = keep_attached

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
            self._session = self._open_session(stub, resp)
        except (grpc.RpcError, PoolUnavailable) as e:
            self._close_channel()
            self.registration = None
            self.backoff.failed()
            if isinstance(e, PoolUnavailable):
                raise
            raise PoolUnavailable(f"register: {e.code()}: {e.details()}") from None
        self.backoff.reset()
        self._socket_id = socket_id
        self.key_size = spec.key_size
        # each registration names its sidecar's map: a restarted one writes a new file
        self.presence = open_presence(self.socket_path, resp.presence_map)
        self.registrations += 1
        self.registration = RegisterResult.from_response(resp)
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
    ) -> _Session | FramedSession:
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
        session = _Session(stub, resp.client_id, timeout_s)
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
                for q, salt in zip(queries, salts or _no_salts(len(queries)), strict=True)
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
        slots = _slots(r.slots)
        return Pinned(r.pin_id, slots, _versions(r.versions, len(slots)))

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
            for keys, salt in zip(key_lists, salts or _no_salts(len(key_lists)), strict=True)
        ]
        out: list[Pinned | None] = []
        deadline = self.rpc_timeout_s if timeout_s is None else timeout_s
        for r in session.call_many(deadline, calls):
            if isinstance(r, PoolUnavailable):
                out.append(None)
            else:
                slots = _slots(r.reserve_load.slots)
                versions = _versions(r.reserve_load.versions, len(slots))
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
        return StoreReservation(r.store_id, r.decisions, _slots(r.slots))

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


class RpcThread:
    """One daemon thread running queued calls in order, off the engine's step thread.

    `submit` never blocks; a call that raises is logged and dropped (its caller
    learns the outcome through whatever the call itself records).
    """

    def __init__(self, name: str):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], object]) -> None:
        self._q.put(fn)

    def _run(self) -> None:
        while True:
            fn = self._q.get()
            if fn is None:
                return
            try:
                fn()
            except Exception:  # noqa: BLE001
                log.exception("kvoffload: background call failed")

    def drain(self, timeout_s: float = 5.0) -> bool:
        """Wait until every call submitted so far has run (tests, shutdown)."""
        done = threading.Event()
        self._q.put(done.set)
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 2.0) -> None:
        self._q.put(None)
        self._thread.join(timeout_s)
