"""Block ids to the GPU without an allocation per job: persistent pinned host buffers and one
growing device buffer per stream (`BlockIds`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvoffload_connector.worker.transfer.cuda_driver import NO_TIMING, NOT_READY, driver_ok


@dataclass
class HostIds:
    """One pinned host buffer of block ids and the event recorded after its last upload."""

    tensor: Any  # torch int64, pinned
    view: np.ndarray  # numpy view of ``tensor`` (same memory)
    ptr: int
    uploaded: Any  # CUevent (no timing)


class BlockIds:
    """A pipe's block-id upload: persistent pinned host buffers -> one device buffer, with one
    ``np.copyto`` and one async H2D copy per job on the pipe's kernel stream (no pinned or
    device allocation per job; ``cudaHostAlloc`` per job cost ~0.1-0.3 ms before a STORE's
    first gather).

    Why reuse is safe:
    - Device buffer: written only by ``upload``, queued on the kernel stream, and read only by
      copy kernels queued on that same stream. A stream runs its work in order, so job N+1's
      upload starts after every kernel of job N (and earlier) has finished reading the buffer:
      no event or second buffer is needed. It is allocated with the kernel stream current, so
      torch's caching allocator never hands it memory another stream's queued work still uses.
      When a job needs more ids the buffer grows (geometrically) and the old one is retired,
      not freed: earlier kernels may still read it; retired buffers go at ``close``.
    - Pinned host buffers: the H2D copy reads one after ``upload`` returns. Each has an event
      recorded on the kernel stream after its copy; a buffer is refilled only when
      ``cuEventQuery`` says that copy is done (a never-recorded event counts as done). The
      oldest buffer is tried first; if it is still in use (jobs queued deeper than the ring),
      a new buffer joins the ring instead: ``submit()`` never waits for the GPU here.
    """

    def __init__(self, torch: Any, device: Any, stream: Any, n: int) -> None:
        from cuda.bindings import driver as drv

        self.torch = torch
        self._drv = drv
        self._device = device
        self._stream = stream  # torch.cuda.Stream: the kernel stream
        n = max(1, n)
        self._dev = self._device_buffer(n)
        self._retired: list[Any] = []
        self._host: deque[HostIds] = deque(self._host_buffer(n) for _ in range(2))

    @property
    def capacity(self) -> int:
        """Ids the device buffer holds without growing."""
        return int(self._dev.numel())

    @property
    def host_buffers(self) -> int:
        """Pinned buffers in the ring (2, more only if uploads were ever queued deeper)."""
        return len(self._host)

    def _device_buffer(self, n: int) -> Any:
        with self.torch.cuda.stream(self._stream):
            return self.torch.empty(n, dtype=self.torch.int64, device=self._device)

    def _host_buffer(self, n: int) -> HostIds:
        t = self.torch.empty(n, dtype=self.torch.int64, pin_memory=True)
        ev = driver_ok(self._drv.cuEventCreate(NO_TIMING), "cuEventCreate")
        return HostIds(t, t.numpy(), t.data_ptr(), ev)

    def upload(self, ids: np.ndarray, stream: Any) -> int:
        """Queue ``ids`` (int64) to the device buffer on ``stream`` (the kernel stream's
        CUstream); return the device address. Never waits for the GPU."""
        n = len(ids)
        if n > self.capacity:
            self._retired.append(self._dev)
            self._dev = self._device_buffer(max(n, 2 * self.capacity))
        host = self._host[0]
        idle = self._idle(host)
        if idle and n <= len(host.view):
            self._host.rotate(-1)
        else:
            if idle:  # too small and its last copy is done: freeing it is safe
                self._drv.cuEventDestroy(self._host.popleft().uploaded)
            size = max(n, max(len(h.view) for h in self._host) if self._host else n)
            host = self._host_buffer(size)
            self._host.append(host)
        np.copyto(host.view[:n], ids)
        dev = self._dev.data_ptr()
        if n:
            driver_ok(self._drv.cuMemcpyAsync(dev, host.ptr, 8 * n, stream), "cuMemcpyAsync ids")
            driver_ok(self._drv.cuEventRecord(host.uploaded, stream), "cuEventRecord")
        return dev

    def _idle(self, host: HostIds) -> bool:
        err = int(self._drv.cuEventQuery(host.uploaded)[0])
        if err not in (0, NOT_READY):
            raise RuntimeError(f"cuEventQuery failed: {err}")
        return err == 0

    def close(self, destroy: Any) -> None:
        for h in self._host:
            destroy(h.uploaded)
        self._host.clear()
        self._retired.clear()
        self._dev = None
