"""A test hook for the pool file's pre-fault: it touches a chunk only when a test allowed it."""

from __future__ import annotations

import threading


class PrefaultGate:
    """Test hook: the pre-fault thread touches a chunk only after `step` allowed it.

    `step(n)` lets `n` more chunks through and waits until they are done, so a test can walk the
    pool from "nothing ready" to "ready" deterministically. `close()` lets everything through.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._allowed = 0
        self._taken = 0
        self._done = 0
        self._open = False
        self._finished = False

    def step(self, n: int = 1, timeout: float = 10.0) -> int:
        """Allow `n` more chunks; return the number done so far once they finished (or timeout)."""
        with self._cond:
            self._allowed += n
            self._cond.notify_all()
            target = self._allowed
            self._cond.wait_for(lambda: self._done >= target or self._finished, timeout)
            return self._done

    def close(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def _acquire(self, stop: threading.Event) -> bool:
        with self._cond:
            while not (self._open or self._taken < self._allowed or stop.is_set()):
                self._cond.wait(0.1)
            if stop.is_set():
                return False
            self._taken += 1
            return True

    def _chunk_done(self, finished: bool = False) -> None:
        with self._cond:
            self._done += 1
            self._finished = self._finished or finished
            self._cond.notify_all()

    def _finish(self) -> None:
        with self._cond:
            self._finished = True
            self._cond.notify_all()
