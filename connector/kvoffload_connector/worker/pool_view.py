"""The worker's mapping of its rank's region of the sidecar's shared-memory pool file.

The sidecar creates and pre-faults ``pool-0.shm``; each vLLM worker maps only its rank's slots
(``[offset, offset + slot_count * slot_bytes)``) and, on a CUDA device, page-locks them with
``cudaHostRegister`` so copies run as DMA at PCIe speed. Registration runs in pieces of at most
1 GiB on a background thread (0.095 s/GB measured on an H100 host: 16 GiB take ~1.5 s), each
piece once the pool owner's pre-fault has passed it (pool_pieces.py: its pages are then the
owner's, never allocated by this process). Slots below the last registered piece's end are
usable at once (``usable_end``, which only grows); ``ready`` is True once every piece is.

Piece boundaries fall on slot and page boundaries, so no slot straddles two registrations and a
copy of a whole slot (or of a run of slots inside one piece) is one registered range.

A file shrunk under the mapping (``truncate``, a full tmpfs cleaned up by hand) turns every touch
of the bytes past its new end into SIGBUS, which kills the vLLM worker. The view keeps the file
open so ``intact()`` (one ``fstat``, ~1 µs) can tell before a step's copies whether the mapping
is still backed; the worker checks it once per step that has jobs and drops the view when not.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import threading
import time
from typing import TYPE_CHECKING

from kvoffload_connector.worker.pool_pieces import (
    WHOLE_POOL_PREFAULTED,
    CudaRegistrar,
    PrefaultWatch,
    Registrar,
)

if TYPE_CHECKING:
    import torch

__all__ = ["PoolView", "REGISTER_PIECE_BYTES"]

log = logging.getLogger(__name__)

REGISTER_PIECE_BYTES = 1 << 30  # cudaHostRegister granularity: bounded latency per call
REGISTER_YIELD_S = 0.005  # after each piece: the step's copies get the driver in between
_PAGE = mmap.ALLOCATIONGRANULARITY
_PREFAULT_POLL_S = 0.05  # a piece the owner's pre-fault has not passed is checked this often


class PoolView:
    """A shared mapping of ``slot_count`` slots of ``slot_bytes`` each, as a uint8 tensor.

    ``tensor`` is ``[slot_count, slot_bytes]`` over the mapping (writes go to the file, visible to
    every process that maps it). ``base_ptr`` is slot 0's address. Not thread-safe except for
    ``usable_end`` and ``ready``, which the registration thread advances, and ``intact``.

    Remaining race: ``intact()`` is a check, not a lock. A truncate that lands between the check
    and a copy (or while an async copy of an earlier step still runs) still faults: SIGBUS for a
    CPU copy. Only a person or a bug shrinks the pool file, the window is the length of one
    step's copies, and after the first check that fails nothing touches the mapping again.
    On CUDA the registered (pinned) pages outlive the truncate, so DMA copies do not fault there;
    CPU-side touches would, and the check keeps them off.
    """

    def __init__(self, path: str, offset: int, slot_bytes: int, slot_count: int) -> None:
        """Use :meth:`open`."""
        self.path = path
        self.offset = offset
        self.slot_bytes = slot_bytes
        self.slot_count = slot_count
        self.piece_bytes = _piece_bytes(slot_bytes)
        self._mm: mmap.mmap | None = None
        self.tensor: torch.Tensor
        self.base_ptr = 0
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._registered: list[tuple[int, int]] = []  # (ptr, bytes) page-locked pieces
        self._device: torch.device | None = None
        self._registrar: Registrar | None = None
        self._prefault: PrefaultWatch = WHOLE_POOL_PREFAULTED
        self._usable_end = 0  # slots [0, end) are registered (grows piece by piece)
        # (monotonic seconds since the registration started, usable end) after each piece
        self.progress: list[tuple[float, int]] = []
        self.error = ""  # why registration failed; empty while fine
        self._closed = False
        self._fd = -1  # the pool file, kept open for `intact` (fstat)

    @property
    def needed_bytes(self) -> int:
        """File size the mapping needs: its end offset in the file."""
        return self.offset + self.slot_count * self.slot_bytes

    def file_size(self) -> int:
        """Current size of the mapped file (-1 when closed or it cannot be read)."""
        if self._fd < 0:
            return -1
        try:
            return os.fstat(self._fd).st_size
        except OSError:
            return -1

    def intact(self) -> bool:
        """Whether the file still covers the whole mapping (touching it cannot SIGBUS)."""
        return not self._closed and self.file_size() >= self.needed_bytes

    @classmethod
    def open(cls, path: str, offset: int, slot_bytes: int, slot_count: int) -> PoolView:
        """Map ``slot_count * slot_bytes`` bytes of ``path`` from ``offset`` (page aligned).

        Raises ValueError on bad geometry or a file too small for it, OSError when the file
        cannot be opened.
        """
        if slot_bytes <= 0 or slot_count <= 0:
            raise ValueError(f"slot_bytes and slot_count must be > 0: {slot_bytes}, {slot_count}")
        if offset < 0 or offset % _PAGE:
            raise ValueError(f"pool offset {offset} is not a multiple of the page size {_PAGE}")
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        return cls._map(fd, path, offset, slot_bytes, slot_count)

    @classmethod
    def open_fd(cls, fd: int, name: str, offset: int, slot_bytes: int, slot_count: int) -> PoolView:
        """`open` over a read-write `fd` (a tenant's memfd in node placement: no path; `name`
        stands for it in messages). The view keeps a duplicate; the caller still owns `fd`."""
        if slot_bytes <= 0 or slot_count <= 0:
            raise ValueError(f"slot_bytes and slot_count must be > 0: {slot_bytes}, {slot_count}")
        if offset < 0 or offset % _PAGE:
            raise ValueError(f"pool offset {offset} is not a multiple of the page size {_PAGE}")
        return cls._map(os.dup(fd), name, offset, slot_bytes, slot_count)

    @classmethod
    def _map(cls, fd: int, path: str, offset: int, slot_bytes: int, slot_count: int) -> PoolView:
        """The view over `fd`, which it owns from here (closed when mapping fails)."""
        import torch

        length = slot_bytes * slot_count
        view = cls(path, offset, slot_bytes, slot_count)
        try:
            size = os.fstat(fd).st_size
            if offset + length > size:
                raise ValueError(
                    f"pool file {path} has {size} bytes; {slot_count} slots of {slot_bytes} "
                    f"bytes from offset {offset} need {offset + length}"
                )
            view._mm = mmap.mmap(
                fd,
                length,
                flags=mmap.MAP_SHARED,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
                offset=offset,
            )
        except BaseException:
            os.close(fd)
            raise
        view._fd = fd
        # a normal tensor even when opened inside vLLM's inference_mode: engine threads write it
        with torch.inference_mode(False):
            flat = torch.frombuffer(view._mm, dtype=torch.uint8, count=length)
            view.tensor = flat.view(slot_count, slot_bytes)
        view.base_ptr = flat.data_ptr()
        return view

    def start_device_registration(
        self,
        device: torch.device,
        registrar: Registrar | None = None,
        prefault: PrefaultWatch | None = None,
    ) -> None:
        """Page-lock the mapping for ``device`` in the background, each piece once ``prefault``
        says the owner's pre-fault passed it (default: the whole pool is). ``registrar``
        replaces cudaHostRegister (tests); without one a CPU device needs none: usable at once."""
        if registrar is None and device.type != "cuda":
            self._ready.set()
            return
        if self._thread is not None:
            raise RuntimeError("device registration already started")
        if registrar is None:
            if device.index is None:
                import torch

                device = torch.device("cuda", torch.cuda.current_device())
            registrar = CudaRegistrar(device)
        self._device = device
        self._registrar = registrar
        if prefault is not None:
            self._prefault = prefault
        self._thread = threading.Thread(
            target=self._register, name="kvoffload-pool-register", daemon=True
        )
        self._thread.start()

    @property
    def usable_end(self) -> int:
        """Slots ``[0, usable_end)`` may be copied now: registered with the device (CPU, no
        registration: all). Only grows while the view is open; 0 once closed."""
        if self._closed:
            return 0
        if self._thread is None:
            return self.slot_count
        return self._usable_end

    @property
    def registered_end(self) -> int:
        """Slots ``[0, registered_end)`` are page-locked with the device (0 before any piece,
        and without a registration)."""
        return 0 if self._closed else self._usable_end

    @property
    def ready(self) -> bool:
        """True once the whole mapping can be used for copies (CPU: after start or always)."""
        return self.usable_end >= self.slot_count

    @property
    def registered(self) -> bool:
        """True once every piece is page-locked with the device; False on CPU."""
        return bool(self._registered) and self._ready.is_set() and not self._closed

    @property
    def registered_bytes(self) -> int:
        """Bytes of the mapping usable for copies now (all of it without a registration)."""
        return self.usable_end * self.slot_bytes

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until ready (tests, benchmarks); returns ``ready``."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.ready

    def pieces(self) -> list[tuple[int, int]]:
        """``(first_slot, end_slot)`` of each registration piece (copies stay inside one)."""
        per = self.piece_bytes // self.slot_bytes
        return [(s, min(s + per, self.slot_count)) for s in range(0, self.slot_count, per)]

    def _register(self) -> None:
        registrar = self._registrar
        assert registrar is not None
        try:
            t0 = time.monotonic()
            pieces = self.pieces()
            for n, (first, end) in enumerate(pieces):
                if not self._wait_prefault(end):
                    return
                if not self.intact():  # registering faults the pages in: SIGBUS past the end
                    raise RuntimeError(f"the pool file {self.path} shrank under the mapping")
                ptr = self.base_ptr + first * self.slot_bytes
                registrar.register(ptr, (end - first) * self.slot_bytes)
                self._registered.append((ptr, (end - first) * self.slot_bytes))
                self._usable_end = end
                self.progress.append((time.monotonic() - t0, end))
                # the driver serializes registration with this device's copies and event
                # queries: a back-to-back next piece would keep a load waiting for the lock
                # until the last one (the first hit would wait for the whole region)
                if self._stop.wait(REGISTER_YIELD_S):
                    return
                if n == 0 and len(pieces) > 1:
                    log.info(
                        "kvoffload: pool usable from its first %.2f GB after %.2f s; registering "
                        "the other %.2f GB in the background",
                        end * self.slot_bytes / 1e9,
                        time.monotonic() - t0,
                        (self.slot_count - end) * self.slot_bytes / 1e9,
                    )
            total = self.slot_count * self.slot_bytes
            dt = time.monotonic() - t0
            log.info("pool registered: %.2f GB in %.2f s", total / 1e9, dt)
            self._ready.set()
        except Exception as exc:  # surfaced through .error; the connector keeps missing
            self.error = str(exc)
            log.warning("pool registration failed, offload stays off: %s", exc)

    def _wait_prefault(self, end: int) -> bool:
        """Until the owner's pre-fault passed slots ``[0, end)`` (said once); False: closed."""
        said = False
        while not self._prefault.passed(end):
            if not said:
                said = True
                log.info(
                    "kvoffload: registration waits for the pool's pre-fault to pass %.2f GB "
                    "(the pages stay charged to the pool's owner)",
                    end * self.slot_bytes / 1e9,
                )
            if self._stop.wait(_PREFAULT_POLL_S):
                return False
        return not self._stop.is_set()

    def close(self) -> None:
        """Stop registration, unregister, unmap. Views others still hold keep the mapping alive."""
        self._stop.set()
        self._closed = True
        if self._thread is not None:
            self._thread.join()
        if self._registered and self._registrar is not None:
            for ptr, _ in self._registered:
                self._registrar.unregister(ptr)
            self._registered.clear()
        self._ready.clear()
        if self._mm is not None:
            del self.tensor
            self.base_ptr = 0
            # a caller still holding a view of the pool keeps it mapped until that view is freed
            with contextlib.suppress(BufferError):
                self._mm.close()
            self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _piece_bytes(slot_bytes: int) -> int:
    """Largest multiple of lcm(slot, page) <= 1 GiB (at least one such unit)."""
    unit = slot_bytes * _PAGE // math.gcd(slot_bytes, _PAGE)
    return max(unit, REGISTER_PIECE_BYTES // unit * unit)
