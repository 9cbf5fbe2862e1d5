"""Engine liveness from file locks: who may still write the pool's slots (no timers).

A store reservation belongs to an *engine* (one vLLM instance: its scheduler and its worker
ranks), and its slots are reused only after a commit, an abort by that engine, or proof that
no process of the engine can still write them. The proof is kernel state, not a clock: every
worker rank holds an open-file-description read lock (`F_OFD_SETLK`, `F_RDLCK`) on one byte of
the pool file, from before its first store copy until it exits (the kernel drops the lock
when the process dies), and the sidecar probes with `F_OFD_GETLK` for a write lock.

Byte layout (offsets far beyond the file's end; a lock there costs nothing and touches no page):

    LOCK_BASE + (generation index << GEN_SHIFT) + (engine << ENGINE_SHIFT) + rank

- The generation index is drawn with the pool's generation (`generation_index`); a worker
  locks in the range of the generation it maps and moves its lock only after it drained every
  copy into that mapping. A sidecar that starts a new generation (a discarded or rebuilt file)
  hands out store slots only once no lock is held outside its own range: every worker of the
  file's earlier contents has drained or died.
- `engine` is the engine's key (1 .. MAX_ENGINE - 1), made by its scheduler and sent to its
  workers with each step's metadata; `rank` is the worker's rank (< MAX_RANKS).

Pure arithmetic plus one probe class; `Pool` takes the probe as its injectable `liveness`
(`held(start, length) -> bool`), so a model checker can decide deaths itself.
"""

from __future__ import annotations

import fcntl
import os
import struct
from collections.abc import Callable

__all__ = [
    "GEN_SPAN",
    "LOCK_BASE",
    "MAX_ENGINE",
    "MAX_RANKS",
    "FileLocks",
    "Liveness",
    "engine_offset",
    "generation_base",
    "generation_index",
]

LOCK_BASE = 1 << 62
GEN_SHIFT = 42
GEN_BITS = 20
GEN_SPAN = 1 << GEN_SHIFT  # bytes of one generation's range
ENGINE_SHIFT = 8
MAX_RANKS = 1 << ENGINE_SHIFT
MAX_ENGINE = 1 << (GEN_SHIFT - ENGINE_SHIFT)
LOCK_END = LOCK_BASE + (1 << (GEN_SHIFT + GEN_BITS))  # == 2**63: one past the last lock byte

# is any lock held on bytes [start, start + length) of the pool file (by another description)
Liveness = Callable[[int, int], bool]

_FLOCK = struct.Struct("@hhqqi4x")  # struct flock on Linux (64-bit off_t)
_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)


def generation_index(generation: str) -> int:
    """The lock range index of a pool generation (16 hex characters)."""
    return int(generation, 16) >> (64 - GEN_BITS)


def generation_base(generation: str) -> int:
    return LOCK_BASE + (generation_index(generation) << GEN_SHIFT)


def engine_offset(base: int, engine: int, rank: int = 0) -> int:
    """The lock byte of `rank` of `engine` in the generation range starting at `base`."""
    if not 0 < engine < MAX_ENGINE or not 0 <= rank < MAX_RANKS:
        raise ValueError(f"engine {engine} or rank {rank} out of range")
    return base + (engine << ENGINE_SHIFT) + rank


class FileLocks:
    """`Liveness` of the pool file open as `fd`: F_OFD_GETLK asks whether a write lock on the
    range would conflict, i.e. whether some other open file description holds a lock there.
    One syscall (~1 µs)."""

    def __init__(self, fd: Callable[[], int]) -> None:
        self._fd = fd  # the pool's open file, read at each probe (a rebuild reopens it)

    def __call__(self, start: int, length: int) -> bool:
        fd = self._fd()
        if fd < 0 or length <= 0:
            return False
        query = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, length, 0)
        answer = fcntl.fcntl(fd, _F_OFD_GETLK, query)
        return _FLOCK.unpack(answer)[0] != fcntl.F_UNLCK
