"""The shared-memory pool file and its background pre-fault.

The sidecar creates `pool-0.shm` in the pool directory (a tmpfs/hugetlbfs mount shared with the
vLLM container), or reuses the one a dead sidecar left, sizes it exactly with `ftruncate` and maps
it. A background thread then faults
every page in, chunk by chunk, so the vLLM workers never take page faults on the copy path and the
pod's memory is claimed up front. Slots become allocatable as the pre-fault passes their bytes
(`ready_prefix`): the server serves from the first second.

Pre-fault order: first the regions of registered namespaces, interleaved so every rank's region
advances together (a slot needs its bytes on every rank), then everything else in file order.

The file is in a directory other containers write to: someone may truncate, remove or replace it.
`file_problem` tells (the pool's reaper tick asks), `rebuild` sizes and maps it again, and the
pre-fault checks the file still covers a chunk before touching it (past the end is SIGBUS).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvoffload_sidecar import filemode
from kvoffload_sidecar.host import (
    HUGE_PAGE_BYTES,
    can_lock,
    filesystem_type,
    free_bytes,
    free_huge_page_bytes,
)
from kvoffload_sidecar.numa import NUMA_ROOT, bind_thread_to_node
from kvoffload_sidecar.prefault_gate import PrefaultGate

__all__ = [
    "HUGE_PAGE_BYTES",
    "POOL_FILE_NAME",
    "PrefaultGate",
    "Region",
]

log = logging.getLogger(__name__)

POOL_FILE_NAME = "pool-0.shm"
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python's mmap module does not name it
_PROGRESS_EVERY_S = 2.0


class Region:
    """One memory-backed file, exactly `size` bytes, mapped shared; pre-faulted in chunks.

    Thread contract: `lock` is the pool's lock. `ready_prefix`, `set_priority`, `prefaulted_bytes`
    and `done` read or change pre-fault state and must be called with it held; the pre-fault
    thread takes it briefly per chunk and calls `on_progress()` under it after each chunk.
    """

    def __init__(
        self,
        pool_dir: Path | None,
        size: int,
        *,
        lock: threading.Lock,
        chunk_bytes: int = 64 << 20,
        hugepages: bool = False,
        numa_node: int | None = None,
        prefault: bool = True,
        gate: PrefaultGate | None = None,
        on_progress: Callable[[], None] = lambda: None,
    ) -> None:
        # None for a region over a given fd (memfd_region.py): no directory, no file name
        self.pool_dir = Path(pool_dir) if pool_dir is not None else None
        self.path = self.pool_dir / POOL_FILE_NAME if self.pool_dir is not None else None
        self.size = size
        self.page_bytes = HUGE_PAGE_BYTES if hugepages else mmap.PAGESIZE
        self.hugepages = hugepages
        self.numa_node = numa_node
        self.prefault = prefault
        self._lock = lock
        self._gate = gate
        self._on_progress = on_progress
        self._chunk = chunk_bytes
        self._validate()
        self._nchunks = -(-size // chunk_bytes)
        self._chunk_done = bytearray(self._nchunks)
        self._done_bytes = 0
        self._priority: tuple[tuple[int, int], ...] = ()
        self._mm: mmap.mmap | None = None
        self._fd = -1  # the mapped file, kept open to notice it shrink (fstat)
        self._inode: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of the mapped file
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None
        self.reused = False  # open() took over a file left by a sidecar that is gone
        self.started_at = 0.0
        self.finished_at: float | None = None
        self.locked = False  # mlock'ed after pre-fault (`lock_pages`)
        self.lock_seconds: float | None = None

    @property
    def name(self) -> str:
        """What logs call the memory behind the pool."""
        return f"the pool file {self.path}"

    # -- setup -------------------------------------------------------------------------------

    def _validate(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size <= 0:
            raise ValueError(f"pool size must be a positive number of bytes, got {self.size!r}")
        if self.hugepages and self.size % HUGE_PAGE_BYTES:
            raise ValueError(
                f"pool size {self.size} is not a multiple of 2 MiB, required with hugepages"
            )
        if self._chunk <= 0 or self._chunk % self.page_bytes:
            raise ValueError(
                f"prefault chunk {self._chunk} bytes is not a positive multiple of the "
                f"page size {self.page_bytes}"
            )
        if self.numa_node is not None:
            if self.numa_node < 0:
                raise ValueError(f"numa node must be >= 0, got {self.numa_node}")
            if NUMA_ROOT.is_dir() and not (NUMA_ROOT / f"node{self.numa_node}").is_dir():
                raise ValueError(f"numa node {self.numa_node} does not exist on this host")

    def open(self) -> None:
        """Size and map the pool file (OSError/ValueError if unusable).

        A file left by a sidecar that is gone (killed, OOM; the caller checked that nobody serves
        its socket) is reused, same inode: vLLM may still map it, and a deleted file's pages stay
        allocated while mapped, so a new file would need room for two pools in a size-limited
        emptyDir. Its contents are not trusted (the caller starts an empty index). Only a file
        that cannot be reused is replaced.
        """
        d = self.pool_dir
        if not d.is_dir():
            raise OSError(errno.ENOTDIR, f"pool dir {d} does not exist or is not a directory")
        if not os.access(d, os.W_OK | os.X_OK):
            raise OSError(errno.EACCES, f"pool dir {d} is not writable")
        fstype = filesystem_type(d)
        if self.hugepages and fstype != "hugetlbfs":
            raise ValueError(f"hugepages requested but pool dir {d} is on {fstype}, not hugetlbfs")
        fd = self._open_left_behind()
        allocated = 0
        if fd is not None:
            try:
                allocated = os.fstat(fd).st_blocks * 512
                self._check_room(allocated)  # a new file would need more
                self._map(fd)
                self.reused = True
            except OSError as exc:
                self._mm = None
                if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise  # no room: a new file would need more; kept for the next attempt
                # It cannot be sized or mapped: a new file is the way left.
                self.path.unlink(missing_ok=True)
                log.warning("cannot reuse the pool file %s (%s): replaced it", self.path, exc)
            finally:
                os.close(fd)
        if self._mm is None:
            self._check_room(0)
            fd = os.open(
                self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, filemode.file_mode()
            )
            try:
                self._map(fd)
            except BaseException:
                self.path.unlink(missing_ok=True)
                raise
            finally:
                os.close(fd)
        if fstype not in ("tmpfs", "hugetlbfs", "ramfs"):
            log.warning("pool dir %s is on %s, not a memory filesystem", d, fstype)
        # A reused file whose every page is allocated needs no pre-fault: the pool never reads
        # KV bytes through its own mapping, and the pages the vLLM side maps are there.
        whole = self.reused and not self.hugepages and allocated >= self.size
        if not self.prefault or whole:
            self._chunk_done[:] = b"\x01" * self._nchunks
            self._done_bytes = self.size

    def _map(self, fd: int) -> None:
        """Size the file to the pool and map it shared (the fd may be closed afterwards)."""
        with contextlib.suppress(PermissionError):  # a reused file of another owner
            os.fchmod(fd, filemode.file_mode())  # 0666 in pods: vLLM may run as another uid
        if os.fstat(fd).st_size != self.size:
            os.ftruncate(fd, self.size)
        self._mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        st = os.fstat(fd)
        self._fd = os.dup(fd)  # the caller closes `fd`; this one (not inherited) lives on
        self._inode = (st.st_dev, st.st_ino)

    def _open_left_behind(self) -> int | None:
        """An fd on the pool file an earlier sidecar left, to reuse; None when there is none or
        it cannot be reused (then it is removed: a new one is created)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            why = exc.strerror or str(exc)
        else:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_dev == os.stat(self.pool_dir).st_dev:
                return fd
            os.close(fd)
            why = "not a regular file on the pool dir's filesystem"
        self.path.unlink()  # IsADirectoryError & co: the caller reports the pool as unusable
        log.warning("cannot reuse the pool file %s (%s): replaced it", self.path, why)
        return None

    def _check_room(self, reusable: int) -> None:
        """ENOSPC/ENOMEM unless the pool fits: touching a page past a full tmpfs or an empty
        huge-page pool is SIGBUS. `reusable`: bytes the reused file already holds."""
        d = self.pool_dir
        room = free_bytes(d)
        free = 0 if room is None else room + reusable
        if room is not None and free < self.size:
            raise OSError(
                errno.ENOSPC, f"pool dir {d} has {free} bytes free, the pool needs {self.size}"
            )
        if self.hugepages and self.prefault:
            huge = free_huge_page_bytes()
            if huge is not None and huge + reusable < self.size:
                raise OSError(
                    errno.ENOMEM,
                    f"{huge + reusable} bytes of free 2 MiB huge pages (HugePages_Free - "
                    f"HugePages_Rsvd, and the reused file's), the pool needs {self.size}",
                )

    def start_prefault(self) -> None:
        """Start the background pre-fault (no-op when `prefault=False` or already started)."""
        self.started_at = time.monotonic()
        if not self.prefault:
            self.finished_at = self.started_at
            if self._gate is not None:
                self._gate._finish()
            return
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="kvoffload-prefault", daemon=True
            )
            self._thread.start()

    def close(self, *, remove: bool = False) -> None:
        """Stop the pre-fault thread and unmap; remove the file only when asked (a pool file
        left behind is what the pod's next sidecar adopts)."""
        self.stop_prefault()
        self._unmap()
        if remove:
            self.path.unlink(missing_ok=True)

    def stop_prefault(self) -> None:
        """Stop the pre-fault thread (call without the lock: the thread takes it per chunk)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _unmap(self) -> None:
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # a slot table's view still holds it:
                self._mm.close()  # unmapped when the view goes
            self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # -- the file under us -------------------------------------------------------------------

    def _file_size(self) -> int:
        try:
            return os.fstat(self._fd).st_size if self._fd >= 0 else -1
        except OSError:
            return -1

    def intact(self) -> bool:
        """The mapped file still covers the whole pool (one fstat): writing a page past its end
        would be SIGBUS."""
        return self._fd >= 0 and self._file_size() >= self.size

    def file_problem(self) -> str | None:
        """Why the mapped file no longer backs the pool (shrunk, removed, replaced); None when
        it does. One stat and one fstat."""
        if self._fd < 0:
            return None
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return "was removed"
        except OSError as exc:
            return f"cannot be read ({exc.strerror or exc})"
        if (st.st_dev, st.st_ino) != self._inode:
            return "was replaced by another file"
        size = self._file_size()
        if size < self.size:
            return f"shrank to {size} of {self.size} bytes"
        return None

    def rebuild(self) -> None:
        """Size and map the file at `path` again (the one there, or a new one) and forget what
        was pre-faulted; `stop_prefault()` first, then `start_prefault()` after. Lock held.
        OSError/ValueError when it cannot (the pool then stays unusable)."""
        self._unmap()
        self._stop.clear()
        self.error = None
        self.finished_at = None
        self._chunk_done = bytearray(self._nchunks)
        self._done_bytes = 0
        self.open()

    @property
    def buffer(self) -> mmap.mmap:
        """The pool's own mapping (for tests and tools; the pool never reads KV bytes)."""
        if self._mm is None:
            raise ValueError("region is not open")
        return self._mm

    # -- pre-fault state (lock held) ----------------------------------------------------------

    @property
    def prefaulted_bytes(self) -> int:
        return self._done_bytes

    @property
    def done(self) -> bool:
        return self._done_bytes >= self.size

    def set_priority(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Byte ranges (offset, length) to pre-fault first, advanced together (rank regions)."""
        self._priority = tuple(ranges)

    def ready_prefix(self, offset: int, length: int) -> int:
        """Bytes from `offset` (at most `length`) whose pages are all pre-faulted."""
        if self._done_bytes >= self.size:
            return length
        c = offset // self._chunk
        end = offset + length
        while c < self._nchunks and self._chunk_done[c] and c * self._chunk < end:
            c += 1
        return max(0, min(end, c * self._chunk) - offset)

    def _next_chunk(self) -> int | None:
        best: tuple[int, int] | None = None
        for offset, length in self._priority:
            ready = self.ready_prefix(offset, length)
            if ready < length:
                c = (offset + ready) // self._chunk
                if best is None or ready < best[0]:
                    best = (ready, c)
        if best is not None:
            return best[1]
        idx = self._chunk_done.find(0)
        return None if idx < 0 else idx

    # -- the thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self.numa_node is not None:
                bind_thread_to_node(self.numa_node)
            last_log = time.monotonic()
            while not self._stop.is_set():
                if self._gate is not None and not self._gate._acquire(self._stop):
                    break
                with self._lock:
                    c = self._next_chunk()
                if c is None:
                    break
                start = c * self._chunk
                length = min(self._chunk, self.size - start)
                if self._file_size() < start + length:  # touching past the end is SIGBUS
                    self.error = "the pool file shrank under the mapping"
                    log.warning(
                        "pool pre-fault paused at %d of %d bytes: %s shrank "
                        "under the mapping (the reaper rebuilds it)",
                        self._done_bytes,
                        self.size,
                        self.name,
                    )
                    break
                self._touch(start, length)
                with self._lock:
                    self._chunk_done[c] = 1
                    self._done_bytes += length
                    finished = self._done_bytes >= self.size
                    self._on_progress()
                if self._gate is not None:
                    self._gate._chunk_done(finished)
                now = time.monotonic()
                if now - last_log >= _PROGRESS_EVERY_S:
                    last_log = now
                    self._log_progress(now)
                if finished:
                    break
        except Exception as e:  # a failed pre-fault leaves the rest unallocatable, not a crash
            self.error = f"{type(e).__name__}: {e}"
            log.error(
                "pool pre-fault stopped at %d of %d bytes: %s",
                self._done_bytes,
                self.size,
                self.error,
            )
        finally:
            if self._gate is not None:
                self._gate._finish()
        if self._done_bytes >= self.size and not self._stop.is_set():
            self.lock_pages()
        if self._done_bytes >= self.size:
            self.finished_at = time.monotonic()
            took = max(self.finished_at - self.started_at, 1e-9)
            log.info(
                "pool pre-fault done: %.2f GiB in %.1f s (%.2f GB/s)",
                self.size / 2**30,
                took,
                self.size / took / 1e9,
            )

    def _log_progress(self, now: float) -> None:
        done, total = self._done_bytes, self.size
        rate = done / max(now - self.started_at, 1e-9)
        eta = (total - done) / rate if rate > 0 else float("inf")
        log.info(
            "pool pre-fault: %.2f / %.2f GiB (%.1f%%), %.2f GB/s, ETA %.1f s",
            done / 2**30,
            total / 2**30,
            100 * done / total,
            rate / 1e9,
            eta,
        )

    _populate_ok = True

    def _touch(self, start: int, length: int) -> None:
        """Fault in [start, start+length): MADV_POPULATE_WRITE, else write one byte per page."""
        mm = self.buffer
        if self._populate_ok:
            try:
                mm.madvise(_MADV_POPULATE_WRITE, start, length)
                return
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
                self._populate_ok = False  # old kernel: fall back for good
        # Old kernel: allocate the pages without touching their bytes (an adopted pool's blocks
        # and slot table live in them); where fallocate is not supported either, a new file's
        # pages get a zero in their first byte (nothing there is in use yet).
        try:
            os.posix_fallocate(self._fd, start, length)
            return
        except OSError:
            if self.reused:
                return
        page = self.page_bytes
        n = -(-length // page)
        mm[start : start + n * page : page] = bytes(n)

    def lock_pages(self) -> bool:
        """mlock the whole mapping once every page is allocated, where allowed (`can_lock`), so
        the pool is never swapped out on a node with swap (a swapped-in block costs a disk read
        where a pool hit should cost a memcpy). Without it the kernel may swap idle pool pages;
        ranges a CUDA worker registered (cudaHostRegister) are pinned by that anyway."""
        mm = self._mm
        if mm is None or self.locked:
            return self.locked
        allowed, why = can_lock(self.size)
        if not allowed:
            log.info("pool pages not locked (%s): they may be swapped on a node with swap", why)
            return False
        view = ctypes.c_char.from_buffer(mm)
        try:
            address = ctypes.addressof(view)
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
            start = time.perf_counter()
            rc = libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(self.size))
            took = time.perf_counter() - start
        finally:
            del view  # release the buffer export, or the mmap could not be closed
        if rc != 0:
            err = ctypes.get_errno()
            log.warning("pool pages not locked: mlock failed (%s)", os.strerror(err))
            return False
        self.locked, self.lock_seconds = True, took
        log.info(
            "pool pages locked in memory (%s): %.2f GiB in %.3f s", why, self.size / 2**30, took
        )
        return True
