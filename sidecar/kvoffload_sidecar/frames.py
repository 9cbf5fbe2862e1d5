"""The Session protocol over a plain Unix stream socket: the connector's hot path without gRPC.

A lookup or reservation is a few hundred microseconds of Python gRPC round trip before the pool
does any work (HTTP/2 framing, the completion queue, per-message callbacks on both sides:
docs/BENCHMARKS.md, "Sidecar RPC"). This socket carries the same `kvoffload.v1` messages with
the same rules as the `Session` stream, each framed as a 4-byte little-endian length and the
serialized message: attach first, answers in order, and the connection owns the client's pins
(released, after the detach grace, when it closes). Registration, stats and health stay on gRPC.

Each connection is served by its own thread doing blocking reads and writes: a connection is one
engine rank or scheduler (a handful per pod), and a thread woken by its socket answers about
70 µs sooner than an asyncio stream handler (the event loop's reader callbacks, futures and
write buffering; docs/BENCHMARKS.md, "Sidecar RPC"). The pool serialises calls with its own lock.
At most `max_sessions` connections are served at once (`--max-sessions`): one more is answered
with one RESOURCE_EXHAUSTED `SessionError` frame and closed, so idle or leaked connections cannot
pile up threads. The socket is mode 0666: vLLM may run as any uid of the pod. A server given
`admit` asks it about each accepted connection before reading anything from it: a connection it
refuses is answered with one PERMISSION_DENIED `SessionError` frame (the reason) and closed
(the node agent's peer attestation).

Bad input gets what the gRPC stream gives it: a frame that does not parse is answered with an
INVALID_ARGUMENT `SessionError` (seq 0); a length above the gRPC message limit, or a connection
that ends inside a frame, closes that connection only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvoffload.v1 import pool_pb2 as pb

from kvoffload_sidecar import filemode
from kvoffload_sidecar.config import FRAMED_SUFFIX, remove_stale_socket
from kvoffload_sidecar.sessions import SessionHost

log = logging.getLogger(__name__)

HEADER = struct.Struct("<I")
_BACKLOG = 64
DEFAULT_MAX_SESSIONS = 64
_RESOURCE_EXHAUSTED = 8  # grpc.StatusCode.RESOURCE_EXHAUSTED (no grpc import here)
_PERMISSION_DENIED = 7  # grpc.StatusCode.PERMISSION_DENIED
_REFUSE_SEND_TIMEOUT_S = 0.2


def socket_path_for(grpc_socket: Path) -> Path:
    """Where the framed socket of a sidecar serving gRPC on `grpc_socket` listens."""
    return grpc_socket.with_name(grpc_socket.name + FRAMED_SUFFIX)


class FrameTooLarge(Exception):
    """A frame announced more bytes than a message may have: the connection is closed."""


class CutFrame(Exception):
    """The connection ended inside a frame: the client went away mid-request."""


class FrameReader:
    """Whole frames off a blocking socket, into one reused buffer (no copy per `recv`)."""

    def __init__(self, conn: socket.socket, max_bytes: int) -> None:
        self._conn = conn
        self._max = max_bytes
        self._buf = bytearray(1 << 16)

    def _fill(self, view: memoryview, at_boundary: bool) -> bool:
        """Fill `view` completely; False on a clean end before its first byte at a boundary."""
        got, n = 0, len(view)
        while got < n:
            k = self._conn.recv_into(view[got:])
            if not k:
                if got == 0 and at_boundary:
                    return False
                raise CutFrame(f"connection ended {got} bytes into a {n}-byte read")
            got += k
        return True

    def next(self) -> bytes | None:
        """One frame's payload; None when the peer closed between frames."""
        header = memoryview(self._buf)[: HEADER.size]
        if not self._fill(header, at_boundary=True):
            return None
        (size,) = HEADER.unpack(header)
        if size > self._max:
            raise FrameTooLarge(f"frame of {size} bytes is above the {self._max}-byte limit")
        if size > len(self._buf):
            self._buf = bytearray(size)
        body = memoryview(self._buf)[:size]
        self._fill(body, at_boundary=False)
        return bytes(body)


def frame(message: bytes) -> bytes:
    return HEADER.pack(len(message)) + message


@dataclass
class FramedSessions:
    """The framed socket's server, bound to one `SessionHost` (its handlers and counters)."""

    servicer: SessionHost
    path: Path
    max_frame_bytes: int
    max_sessions: int = DEFAULT_MAX_SESSIONS
    # None to serve an accepted connection, else why it is refused (module docstring)
    admit: Callable[[socket.socket], str | None] | None = None
    refused: int = 0  # connections refused because `max_sessions` were open
    denied: int = 0  # connections `admit` refused
    _refusing: bool = False  # inside a burst of refusals: logged once
    _listener: socket.socket | None = None
    _conns: dict[socket.socket, threading.Thread] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stopping: bool = False

    async def start(self) -> None:
        remove_stale_socket(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(self.path))
            os.chmod(self.path, filemode.file_mode())  # before listen: no client sees it wider
            listener.listen(_BACKLOG)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        threading.Thread(
            target=self._accept_forever,
            args=(listener,),
            name="kvoffload-framed-accept",
            daemon=True,
        ).start()
        log.info("framed sessions on %s", self.path)

    async def stop(self, grace_s: float) -> None:
        """Stop accepting, close every connection (their sessions detach), unlink the socket."""
        listener = self._listener
        if listener is None:
            return
        self._listener = None
        with self._lock:
            self._stopping = True
            conns = dict(self._conns)
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # wakes a blocked recv(): the session ends
        await asyncio.to_thread(_join_all, list(conns.values()), grace_s)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def close_all(self) -> int:
        """Shut every open connection (their sessions end and detach); keep accepting.
        Returns how many."""
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # wakes a blocked recv(): the session ends
        return len(conns)

    def _accept_forever(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # stop() shut the listener
            why = self.admit(conn) if self.admit is not None else None
            if why is not None:
                self.denied += 1
                log.info("refusing framed session: %s", why)
                _send_refusal(conn, _PERMISSION_DENIED, why)
                continue
            thread = threading.Thread(
                target=self._serve, args=(conn,), name="kvoffload-framed-session", daemon=True
            )
            with self._lock:
                if self._stopping:
                    conn.close()
                    return
                full = len(self._conns) >= self.max_sessions
                if not full:
                    self._conns[conn] = thread
                    self._refusing = False
            if full:
                self._refuse(conn)
            else:
                thread.start()

    def _refuse(self, conn: socket.socket) -> None:
        """One RESOURCE_EXHAUSTED frame, then close; logged once per burst of refusals."""
        self.refused += 1
        message = f"refusing framed session: {self.max_sessions} open (--max-sessions)"
        if not self._refusing:
            self._refusing = True
            log.warning("%s", message)
        _send_refusal(conn, _RESOURCE_EXHAUSTED, message)

    def _serve(self, conn: socket.socket) -> None:
        servicer = self.servicer
        parse = servicer.parse_session_request
        reader = FrameReader(conn, self.max_frame_bytes)
        client_id = 0
        servicer.session_opened()
        try:
            first = reader.next()
            if first is None:
                return
            client_id, reply = servicer.attach_session(parse(first))
            conn.sendall(frame(reply.SerializeToString()))
            if not client_id:
                return  # the error went back as a SessionError; the connection ends
            call, flush = servicer.session_call, servicer.flush_deferred
            while True:
                payload = reader.next()
                if payload is None:
                    return
                conn.sendall(frame(call(parse(payload), client_id).SerializeToString()))
                flush()  # bookkeeping the answer did not need, after sending
        except FrameTooLarge as e:
            log.warning("framed session of client %d closed: %s", client_id, e)
        except (CutFrame, OSError):
            pass  # the client went away mid-frame, or stop() shut us: same as a dropped stream
        except Exception:  # noqa: BLE001 - a bug here must end one session, not the sidecar
            log.exception("framed session of client %d failed", client_id)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            servicer.session_closed()
            servicer.end_session(client_id)
            conn.close()


def _send_refusal(conn: socket.socket, code: int, message: str) -> None:
    """One `SessionError` frame (seq 0) with `code`, then close."""
    reply = pb.SessionResponse(seq=0)
    reply.error.code = code
    reply.error.message = message
    try:
        conn.settimeout(_REFUSE_SEND_TIMEOUT_S)  # never let a refused peer stall accept()
        conn.sendall(frame(reply.SerializeToString()))
    except OSError:
        pass
    finally:
        conn.close()


def _join_all(threads: list[threading.Thread], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
