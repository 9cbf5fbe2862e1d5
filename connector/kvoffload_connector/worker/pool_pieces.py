"""How a worker rank page-locks its mapping with the device: piece by piece, behind the pre-fault.

`PoolView` registers its mapping in pieces (at most 1 GiB, on slot and page boundaries) on a
background thread, and slots below the last registered piece's end are usable for copies at
once (`PoolView.usable_end`): a rank attaching to a big pool serves hits from its first piece.
Two things are injectable, so tests can drive the registration piece by piece:

- a `Registrar` page-locks and unlocks one range (`CudaRegistrar`: `cudaHostRegister` and
  `cudaHostUnregister` for one device);
- a `PrefaultWatch` says whether the pool owner's pre-fault has passed a piece. Registering
  touches every page of the piece, so a page the owner has not allocated yet would be allocated
  by the vLLM process and charged to its container's memory cgroup; behind the owner's
  pre-fault every page is already allocated and stays charged to the owner (the sidecar's
  container, or the node's holder). `ServerPrefault` reads it from the Register answer and,
  while that pre-fault runs, from the pool's Stats at a bounded rate.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

__all__ = [
    "CudaRegistrar",
    "PrefaultState",
    "PrefaultWatch",
    "Registrar",
    "ServerPrefault",
    "WHOLE_POOL_PREFAULTED",
]

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.25  # at most this often a waiting registration asks the pool again


class Registrar(Protocol):
    """Page-locks ranges of a mapping for the device. Called from the registration thread."""

    def register(self, ptr: int, nbytes: int) -> None:
        """Page-lock `[ptr, ptr + nbytes)`; RuntimeError when the device refuses."""

    def unregister(self, ptr: int) -> None:
        """Undo one `register` (the range that started at `ptr`)."""


class CudaRegistrar:
    """`cudaHostRegister` on `device` (the registration thread sets it first)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cudart: Any = None

    def _runtime(self) -> Any:
        if self._cudart is None:
            import torch

            torch.cuda.set_device(self.device)
            self._cudart = torch.cuda.cudart()
        return self._cudart

    def register(self, ptr: int, nbytes: int) -> None:
        rc = int(self._runtime().cudaHostRegister(ptr, nbytes, 0))
        if rc != 0:
            raise RuntimeError(f"cudaHostRegister({nbytes} bytes) failed: error {rc}")

    def unregister(self, ptr: int) -> None:
        self._runtime().cudaHostUnregister(ptr)


class PrefaultWatch(Protocol):
    """Whether the pool owner's pre-fault has allocated every page of a rank's slots."""

    def passed(self, end_slot: int) -> bool:
        """True once slots `[0, end_slot)` of the rank's region are pre-faulted."""


@dataclass(frozen=True)
class PrefaultState:
    """What the pool said of its pre-fault: done for the whole pool, or how many of the
    namespace's slots (on every rank) are allocated."""

    done: bool
    slots: int = 0


class _Whole:
    def passed(self, end_slot: int) -> bool:
        return True


WHOLE_POOL_PREFAULTED: PrefaultWatch = _Whole()  # a pool file pre-faulted already, tests


class ServerPrefault:
    """The owner's pre-fault as its answers tell it: `first` from the Register answer
    (`prefault_fraction` 1: done), then, only while a piece waits for it, `ask()` (the pool's
    Stats: its `pool_ready` and the namespace's `prefaulted_slots`) at most every
    `interval_s`. A failed ask counts as no progress (the piece waits; never a page early)."""

    def __init__(
        self,
        first: PrefaultState,
        ask: Callable[[], PrefaultState],
        interval_s: float = STATS_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._state = first
        self._ask = ask
        self._interval_s = interval_s
        self._clock = clock
        self._asked_at = float("-inf")
        self._lock = threading.Lock()
        self.asks = 0  # Stats calls made (tests: the rate is bounded)

    def passed(self, end_slot: int) -> bool:
        with self._lock:
            if self._covers(end_slot):
                return True
            now = self._clock()
            if now - self._asked_at < self._interval_s:
                return False
            self._asked_at = now
            self.asks += 1
            try:
                got = self._ask()
            except Exception as e:  # noqa: BLE001 - the pool away: wait, ask again later
                log.debug("kvoffload: pre-fault progress not read: %s", e)
                return False
            # the pool's frontier never moves back; an answer of a rebuilt pool does not matter
            # here (a new generation is a new mapping with its own watch)
            self._state = PrefaultState(
                self._state.done or got.done, max(self._state.slots, got.slots)
            )
            return self._covers(end_slot)

    def _covers(self, end_slot: int) -> bool:
        return self._state.done or end_slot <= self._state.slots
