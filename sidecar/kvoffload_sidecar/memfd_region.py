"""The pool's region over a given sealed memfd (node mode: one tenant's memory in the node agent).

Node mode hands the agent each tenant's memory as a memfd (`kvoffload_sidecar.node`): sized to
the tenant's share and sealed against growing and shrinking when it was made, never reachable by
a path. `MemfdRegion` is `Region` over that fd: it maps it, never unlinks, truncates or resizes
it, answers `intact()` from `fstat` (the size is still the sealed size), and `rebuild()` maps
the same fd again (the pool then writes a new header in place: a new generation, under which no
earlier namespace header or slot table validates, as in pod mode).

Pre-fault: `posix_fallocate` per chunk, in the same order and under the same rule as the pool
file (a slot is handed out only once every page behind it is allocated). Pages are charged to
the memory cgroup of the task that allocates them first, so `FdBacking.allocate` lets the
caller have another process allocate each range (the node holder, whose container's memory is
the node pool); pages already allocated cost nothing to allocate again.

The memfd may hold the index of an agent before this one (the holder lends the same memory to
a restarted agent): the pool reads its header and adopts it exactly as a restarted sidecar
adopts its pool file; a memfd no agent wrote an index into is zero-filled, a new pool.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvoffload_sidecar.prefault_gate import PrefaultGate
from kvoffload_sidecar.region import Region

__all__ = ["REQUIRED_SEALS", "FdBacking", "MemfdRegion"]

REQUIRED_SEALS = fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK


@dataclass(frozen=True)
class FdBacking:
    """The memory a pool lives in when it is not a file of its own.

    `fd`: a memfd of exactly the pool's size, sealed against growing and shrinking (the region
    maps its own duplicate; the caller keeps and closes this one). `name`: what logs call it.
    `allocate(offset, length)`: allocates that range's pages for the pre-fault (default:
    `posix_fallocate` from this process, which is then charged for them).
    """

    fd: int
    name: str
    allocate: Callable[[int, int], None] | None = None


class MemfdRegion(Region):
    """`Region` over `backing.fd`: same thread contract, same pre-fault state."""

    def __init__(
        self,
        backing: FdBacking,
        size: int,
        *,
        lock: threading.Lock,
        chunk_bytes: int = 64 << 20,
        numa_node: int | None = None,
        prefault: bool = True,
        gate: PrefaultGate | None = None,
        on_progress: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(
            None,
            size,
            lock=lock,
            chunk_bytes=chunk_bytes,
            hugepages=False,
            numa_node=numa_node,
            prefault=prefault,
            gate=gate,
            on_progress=on_progress,
        )
        self.backing = backing

    @property
    def name(self) -> str:
        return self.backing.name

    def open(self) -> None:
        """Map the memfd (ValueError when it is not the sealed size, OSError when it cannot be
        mapped). It may hold an earlier agent's index (`reused`: the pool reads its header)."""
        fd = self.backing.fd
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{self.name} is not a memory file")
        if st.st_size != self.size:
            raise ValueError(f"{self.name} holds {st.st_size} bytes, the pool needs {self.size}")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as exc:
            raise ValueError(f"{self.name} cannot be sealed ({exc.strerror})") from None
        if seals & REQUIRED_SEALS != REQUIRED_SEALS:
            # another holder could shrink it under the mapping: SIGBUS
            raise ValueError(f"{self.name} is not sealed against resize (seals {seals:#x})")
        self._mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._fd = os.dup(fd)  # not inherited; the caller's fd stays the caller's
        self._inode = (st.st_dev, st.st_ino)
        self.reused = True
        # every page allocated (the holder's pre-fault finished, or an agent before this one
        # pre-faulted it): nothing to allocate
        if not self.prefault or st.st_blocks * 512 >= self.size:
            self._chunk_done[:] = b"\x01" * self._nchunks
            self._done_bytes = self.size

    def intact(self) -> bool:
        """The memfd still has its sealed size (one fstat; the seals make this always true)."""
        return self._fd >= 0 and self._file_size() == self.size

    def file_problem(self) -> str | None:
        if self._fd < 0:
            return None
        size = self._file_size()
        if size != self.size:
            return f"is {size} of {self.size} bytes"
        return None

    def close(self, *, remove: bool = False) -> None:
        """Stop the pre-fault and unmap; the memfd itself is the caller's (`remove` is moot:
        a memfd has no name to remove, and its memory lives while any holder keeps it)."""
        del remove
        self.stop_prefault()
        self._unmap()

    def lock_pages(self) -> bool:
        """Not here: `mlock` would fill this process's page tables for the whole tenant (8 bytes
        per 4 KiB page, 2 GiB per TiB, charged to the agent) to pin pages the agent never
        reads; the pool file's sidecar maps its pages anyway. Without it, a node with swap
        may swap a tenant's idle pages; ranges a CUDA worker registered are pinned by that."""
        return False

    def _touch(self, start: int, length: int) -> None:
        allocate = self.backing.allocate
        if allocate is not None:
            allocate(start, length)
        else:
            os.posix_fallocate(self._fd, start, length)
