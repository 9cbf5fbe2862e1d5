"""The connector's session on the sidecar's framed socket (no gRPC on the hot path).

Same protocol and contract as the gRPC `Session` stream (`client._Session`): attach first,
answers in order, one exchange at a time; the connection owns this client's pins. Each
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
import itertools
import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator, Sequence

from google.protobuf.message import DecodeError
from kvoffload.v1 import pool_pb2

from kvoffload_connector.errors import PoolUnavailable

log = logging.getLogger(__name__)

HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = 32 << 20  # the sidecar's message limit
_HANGUP = select.POLLRDHUP | select.POLLHUP | select.POLLERR  # peer closed (Linux)
_WATCH_MS = 500  # the watcher re-checks `close()` this often; a hang-up wakes it at once


class FramedSession:
    """One framed connection to the sidecar, attached to `client_id`."""

    def __init__(self, path: str, client_id: int, attach_timeout_s: float):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._turn = threading.Lock()  # the exchange in flight owns the connection
        self._seq = itertools.count(1)
        self._buf = bytearray()  # bytes read past the last answer (none, answers come in order)
        self.alive = True
        try:
            self._sock.settimeout(attach_timeout_s)
            self._sock.connect(path)
        except OSError as e:
            self.close()
            raise PoolUnavailable(f"connect {path}: {e}") from None
        attach = pool_pb2.SessionRequest(seq=0, attach=pool_pb2.AttachRequest(client_id=client_id))
        with self._exchange(attach_timeout_s) as deadline:
            self._send_all(self._frame(attach), deadline, attach_timeout_s)
            reply = self._answer(0, deadline, attach_timeout_s)
        if reply.WhichOneof("result") == "error":
            self.close()
            raise PoolUnavailable(f"attach refused: {reply.error.message}")
        self._closed = threading.Event()
        threading.Thread(target=self._watch, name="kvoffload-framed-watch", daemon=True).start()

    def _watch(self) -> None:
        """Notice the sidecar closing the connection between calls (it died or restarted), as
        gRPC's done callback does for the stream: `alive` turns False at once, so callers
        re-register before their next call instead of learning it from a failed one. Polls
        for hang-up only (never reads), so it cannot race an exchange for the answers."""
        poller = select.poll()
        try:
            poller.register(self._sock.fileno(), _HANGUP)
        except (OSError, ValueError):
            return
        while self.alive and not self._closed.is_set():
            try:
                events = poller.poll(_WATCH_MS)
            except OSError:
                return
            if any(ev & _HANGUP for _, ev in events):
                if self.alive and not self._closed.is_set():
                    log.info("kvoffload: the sidecar closed the framed session")
                self.alive = False
                return

    # -- transport ------------------------------------------------------------------
    @staticmethod
    def _frame(message: pool_pb2.SessionRequest) -> bytes:
        data = message.SerializeToString()
        return HEADER.pack(len(data)) + data

    @contextlib.contextmanager
    def _exchange(self, timeout_s: float) -> Iterator[float]:
        """Hold the connection for one exchange; yields its monotonic deadline."""
        timeout_s = max(0.0, timeout_s)
        deadline = time.monotonic() + timeout_s  # waiting for the turn counts against it
        if not self._turn.acquire(timeout=timeout_s):
            raise PoolUnavailable(f"session busy past {timeout_s * 1e3:.0f} ms")
        try:
            if not self.alive:
                raise PoolUnavailable("session closed")
            yield deadline
        finally:
            self._turn.release()

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
        self.alive = False
        with contextlib.suppress(OSError):
            self._sock.close()

    # -- calls ----------------------------------------------------------------------
    def call(self, timeout_s: float, **call) -> pool_pb2.SessionResponse:
        with self._exchange(timeout_s) as deadline:
            seq = next(self._seq)
            request = self._frame(pool_pb2.SessionRequest(seq=seq, **call))
            self._send_all(request, deadline, timeout_s)
            resp = self._answer(seq, deadline, timeout_s)
        if resp.WhichOneof("result") == "error":
            raise PoolUnavailable(f"sidecar error {resp.error.code}: {resp.error.message}")
        return resp

    def call_many(
        self, timeout_s: float, calls: Sequence[dict]
    ) -> list[pool_pb2.SessionResponse | PoolUnavailable]:
        """Pipelined: every call goes out in one write before the first answer is read. Per
        call its response or its error; a connection that ends or stays silent past the
        deadline raises for all."""
        with self._exchange(timeout_s) as deadline:
            seqs = [next(self._seq) for _ in calls]
            data = b"".join(
                self._frame(pool_pb2.SessionRequest(seq=seq, **call))
                for seq, call in zip(seqs, calls, strict=True)
            )
            self._send_all(data, deadline, timeout_s)
            answers = [self._answer(seq, deadline, timeout_s) for seq in seqs]
        return [
            PoolUnavailable(f"sidecar error {r.error.code}: {r.error.message}")
            if r.WhichOneof("result") == "error"
            else r
            for r in answers
        ]

    def close(self) -> None:
        closed = getattr(self, "_closed", None)
        if closed is not None:
            closed.set()
        self._fail()
