"""The connector's session on the sidecar's framed socket (no gRPC on the hot path).

Same protocol and contract as the gRPC `Session` stream (`grpc_session.GrpcSession`): attach
first, answers in order, one exchange at a time; the connection owns this client's pins. Each
message is a 4-byte little-endian length and a serialized `SessionRequest` / `SessionResponse`
(kvoffload.v1, see `RegisterResponse.session_socket`). A blocking socket with a timeout per
exchange enforces deadlines (no watchdog; a thread blocked in poll() only notices a hang-up
between calls, as gRPC's done callback does). A sidecar silent past a deadline is treated as
gone: the connection is closed (so a late answer can never be read as the next call's), the
caller gets `PoolUnavailable`, and `PoolClient.ensure()` registers again. Measured against the
gRPC stream in docs/BENCHMARKS.md ("Sidecar RPC").
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import struct
import threading
import time

from google.protobuf.message import DecodeError
from kvoffload.v1 import pool_pb2

from kvoffload_connector.common.errors import PoolUnavailable
from kvoffload_connector.common.session import OrderedSession

log = logging.getLogger(__name__)

HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = 32 << 20  # the sidecar's message limit
_HANGUP = select.POLLRDHUP | select.POLLHUP | select.POLLERR  # peer closed (Linux)


class FramedSession(OrderedSession):
    """One framed connection to the sidecar, attached to `client_id`."""

    def __init__(self, path: str, client_id: int, attach_timeout_s: float):
        super().__init__()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._buf = bytearray()  # bytes read past the last answer (none, answers come in order)
        try:
            self._sock.settimeout(attach_timeout_s)
            self._sock.connect(path)
        except OSError as e:
            self.close()
            raise PoolUnavailable(f"connect {path}: {e}") from None
        attach = pool_pb2.SessionRequest(seq=0, attach=pool_pb2.AttachRequest(client_id=client_id))
        with self._exchange(attach_timeout_s) as deadline:
            self._send([attach], deadline, attach_timeout_s)
            reply = self._answer(0, deadline, attach_timeout_s)
        if reply.WhichOneof("result") == "error":
            self.close()
            raise PoolUnavailable(f"attach refused: {reply.error.message}")
        self._closed = threading.Event()
        # The watcher sleeps in poll() with no timeout (a timer would take the engine's GIL
        # a few times a second for nothing); `_wake_watcher` wakes it through this pipe.
        self._wake_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        threading.Thread(target=self._watch, name="kvoffload-framed-watch", daemon=True).start()

    def _watch(self) -> None:
        """Notice the sidecar closing the connection between calls (it died or restarted), as
        gRPC's done callback does for the stream: `alive` turns False at once, so callers
        re-register before their next call instead of learning it from a failed one. Polls
        for hang-up only (never reads), so it cannot race an exchange for the answers; the
        session ending (`_fail`, `close`) wakes it through the pipe."""
        poller = select.poll()
        try:
            poller.register(self._sock.fileno(), _HANGUP)
            poller.register(self._wake_r, select.POLLIN | select.POLLHUP)
            while self.alive and not self._closed.is_set():
                events = poller.poll()
                if any(fd != self._wake_r and ev & _HANGUP for fd, ev in events):
                    if self.alive and not self._closed.is_set():
                        log.info("kvoffload: the sidecar closed the framed session")
                    self._mark_ended()
        except (OSError, ValueError):  # the socket closed under us: the session ended
            pass
        finally:
            self._wake_watcher()
            os.close(self._wake_r)

    def _wake_watcher(self) -> None:
        """A byte down the pipe, then close its write end (once): the watcher's poll()
        returns (the byte wakes it even where a forked child still holds the write end)."""
        with self._wake_lock:
            if self._wake_w >= 0:
                with contextlib.suppress(OSError):
                    os.write(self._wake_w, b"x")
                os.close(self._wake_w)
                self._wake_w = -1

    # -- transport ------------------------------------------------------------------
    def _send(self, requests: list[pool_pb2.SessionRequest], deadline: float, timeout_s: float):
        """Every request in one write (a pipelined batch is one syscall)."""
        data = b"".join(
            HEADER.pack(len(body)) + body for body in (r.SerializeToString() for r in requests)
        )
        self._send_all(data, deadline, timeout_s)

    def _left(self, deadline: float, timeout_s: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            self._fail()
            raise PoolUnavailable(f"no answer within {timeout_s * 1e3:.0f} ms")
        return left

    def _send_all(self, data: bytes, deadline: float, timeout_s: float) -> None:
        try:
            self._sock.settimeout(self._left(deadline, timeout_s))
            self._sock.sendall(data)
        except TimeoutError:
            self._fail()
            raise PoolUnavailable(
                f"sidecar took no request within {timeout_s * 1e3:.0f} ms"
            ) from None
        except OSError as e:
            self._fail()
            raise PoolUnavailable(f"session closed: {e}") from None

    def _read(self, n: int, deadline: float, timeout_s: float) -> bytes:
        """`n` bytes off the connection; most answers arrive whole in one `recv`."""
        buf = self._buf
        while len(buf) < n:
            try:
                self._sock.settimeout(self._left(deadline, timeout_s))
                chunk = self._sock.recv(max(n - len(buf), 1 << 16))
            except TimeoutError:
                self._fail()
                raise PoolUnavailable(f"no answer within {timeout_s * 1e3:.0f} ms") from None
            except OSError as e:
                self._fail()
                raise PoolUnavailable(f"session closed: {e}") from None
            if not chunk:
                self._fail()
                raise PoolUnavailable("session closed by the sidecar")
            buf += chunk
        data = bytes(buf[:n])
        del buf[:n]
        return data

    def _answer(self, seq: int, deadline: float, timeout_s: float) -> pool_pb2.SessionResponse:
        """The answer to `seq` (an earlier seq's answer is skipped; a later one is an error)."""
        while True:
            (size,) = HEADER.unpack(self._read(HEADER.size, deadline, timeout_s))
            if size > MAX_FRAME_BYTES:
                self._fail()
                raise PoolUnavailable(f"reply frame of {size} bytes is above the limit")
            try:
                resp = pool_pb2.SessionResponse.FromString(self._read(size, deadline, timeout_s))
            except DecodeError as e:
                self._fail()
                raise PoolUnavailable(f"malformed reply: {e}") from None
            if resp.seq == seq:
                return resp
            if resp.seq > seq:  # answers come in order: the connection is not what we think
                self._fail()
                raise PoolUnavailable(f"answer {resp.seq} arrived before {seq}")

    def _fail(self) -> None:
        self._mark_ended()
        if getattr(self, "_wake_lock", None) is not None:  # attached: a watcher runs
            self._wake_watcher()
        with contextlib.suppress(OSError):
            self._sock.close()

    def close(self) -> None:
        closed = getattr(self, "_closed", None)
        if closed is not None:
            closed.set()
        self._fail()
