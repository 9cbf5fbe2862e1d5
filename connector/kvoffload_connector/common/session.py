"""What the connector's two session transports share (the gRPC stream in client.py, the framed
socket in framed.py): one exchange at a time, answers in order, in-band errors as
`PoolUnavailable`. A transport supplies how requests go out and how one answer comes back."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator, Sequence

from kvoffload.v1 import pool_pb2

from kvoffload_connector.common.errors import PoolUnavailable


def _error_of(resp: pool_pb2.SessionResponse) -> PoolUnavailable | None:
    if resp.WhichOneof("result") == "error":
        return PoolUnavailable(f"sidecar error {resp.error.code}: {resp.error.message}")
    return None


class OrderedSession:
    """A session whose caller reads its own answers: the sidecar answers a session in order,
    so holding it for one exchange at a time costs no latency and needs no reader thread."""

    def __init__(self) -> None:
        self._turn = threading.Lock()  # the exchange in flight owns the session
        self._seq = itertools.count(1)
        self.alive = True  # read on every call: a plain attribute; `ended` mirrors it for waiters
        # Set once no call can succeed (hang-up, deadline, close): the client's keeper sleeps
        # on it while attached instead of waking on a timer in the engine process.
        self.ended = threading.Event()

    def _mark_ended(self) -> None:
        self.alive = False
        self.ended.set()

    # -- what a transport provides ------------------------------------------------------
    def _send(self, requests: list[pool_pb2.SessionRequest], deadline: float, timeout_s: float):
        raise NotImplementedError

    def _answer(self, seq: int, deadline: float, timeout_s: float) -> pool_pb2.SessionResponse:
        """The answer to `seq` (an earlier seq's late answer is skipped)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def _exchange(self, timeout_s: float) -> Iterator[float]:
        """Hold the session for one exchange; yields its monotonic deadline (waiting for the
        turn counts against it). Transports may extend it (the gRPC one arms a watchdog)."""
        timeout_s = max(0.0, timeout_s)
        deadline = time.monotonic() + timeout_s
        if not self._turn.acquire(timeout=timeout_s):
            raise PoolUnavailable(f"session busy past {timeout_s * 1e3:.0f} ms")
        try:
            if not self.alive:
                raise PoolUnavailable("session closed")
            yield deadline
        finally:
            self._turn.release()

    # -- calls --------------------------------------------------------------------------
    def call(self, timeout_s: float, **call) -> pool_pb2.SessionResponse:
        with self._exchange(timeout_s) as deadline:
            seq = next(self._seq)
            self._send([pool_pb2.SessionRequest(seq=seq, **call)], deadline, timeout_s)
            resp = self._answer(seq, deadline, timeout_s)
        error = _error_of(resp)
        if error is not None:
            raise error
        return resp

    def call_many(
        self, timeout_s: float, calls: Sequence[dict]
    ) -> list[pool_pb2.SessionResponse | PoolUnavailable]:
        """Pipelined: every call goes out before the first answer is read (one round trip for
        the lot). Per call its response or its error; a session that ends or stays silent past
        the deadline raises for all."""
        with self._exchange(timeout_s) as deadline:
            seqs = [next(self._seq) for _ in calls]
            requests = [
                pool_pb2.SessionRequest(seq=seq, **call)
                for seq, call in zip(seqs, calls, strict=True)
            ]
            self._send(requests, deadline, timeout_s)
            answers = [self._answer(seq, deadline, timeout_s) for seq in seqs]
        return [_error_of(r) or r for r in answers]
