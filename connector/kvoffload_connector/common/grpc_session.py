"""The gRPC `Session` stream of a registered client (the framed socket's counterpart:
framed.py); both keep `OrderedSession`'s contract."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterator

import grpc
from kvoffload.v1 import pool_pb2, pool_pb2_grpc

from kvoffload_connector.common.errors import PoolUnavailable
from kvoffload_connector.common.session import OrderedSession

log = logging.getLogger(__name__)


class GrpcSession(OrderedSession):
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
