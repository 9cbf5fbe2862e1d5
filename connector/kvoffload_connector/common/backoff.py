"""The client's reconnect pacing."""

from __future__ import annotations

import time
from collections.abc import Callable


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
