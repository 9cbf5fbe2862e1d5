"""A worker rank's engine lock: the proof, to the sidecar, that this process may still write.

The sidecar reuses a store reservation's slots only after a commit, an abort, or the death of
the engine that owns it, and it learns of a death from the kernel, never from a clock: each
worker rank holds an open-file-description read lock (`F_OFD_SETLK`, `F_RDLCK`) on its byte of
the pool file, or in node placement of the tenant's memfd
(`RegisterResponse.engine_lock_base + (engine << 8) + rank`, far beyond the end of the file),
from before its first store copy until it exits or drained every copy into the
mapping of that generation. The kernel drops the lock when the process dies, so no schedule
(a stopped engine, a GPU stall, a lost session) makes the sidecar hand its slots to another
store while it may still write them. Stdlib only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct

from kvoffload_connector.common.engine_key import ENGINE_SHIFT, MAX_ENGINE

__all__ = ["EngineLock", "lock_offset"]

_FLOCK = struct.Struct("@hhqqi4x")  # struct flock on Linux (64-bit off_t)
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)


def lock_offset(base: int, engine: int, rank: int) -> int:
    if not base or not 0 < engine < MAX_ENGINE or not 0 <= rank < (1 << ENGINE_SHIFT):
        raise ValueError(f"no engine lock for base {base}, engine {engine}, rank {rank}")
    return base + (engine << ENGINE_SHIFT) + rank


class EngineLock:
    """One held lock byte on an open file description of this lock's own: the pool file at
    `path` opened anew (pod placement), or with `fd`, a duplicate of the description behind it
    (a tenant's memfd in node placement; `path` then only names it). Being its own, no other
    open or close of the file in this process can drop it; released by unlocking, since in node
    placement a mapping of the memfd keeps the description open and closing would not drop it.
    OSError when the kernel refuses it."""

    def __init__(self, path: str, offset: int, fd: int | None = None) -> None:
        self.path, self.offset = path, offset
        self._fd = os.dup(fd) if fd is not None else os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._set(fcntl.F_RDLCK)
        except OSError:
            os.close(self._fd)
            self._fd = -1
            raise

    def _set(self, kind: int) -> None:
        fcntl.fcntl(self._fd, _F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, self.offset, 1, 0))

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self) -> None:
        """Only once every copy into this generation's mapping finished (or never started)."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                self._set(fcntl.F_UNLCK)
            os.close(self._fd)
            self._fd = -1
