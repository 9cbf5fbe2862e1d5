"""A thread that runs pool calls off the engine's step thread."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


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
