"""One direction of the CUDA engine: its staging ring, streams and hand-over events (`Pipe`)."""

from __future__ import annotations

from typing import Any

from kvoffload_connector.worker.transfer.cuda_driver import NO_TIMING, driver_ok
from kvoffload_connector.worker.transfer.cuda_ids import BlockIds


class Pipe:
    """One direction's staging ring, streams and hand-over events (raw driver handles: the
    per-piece enqueue path is a few driver calls, no torch wrappers)."""

    def __init__(
        self,
        device: Any,
        capacity: int,
        ring: int,
        priority: int,
        dmas: int,
        ids: int,
        blocking: bool = False,
    ) -> None:
        import torch
        from cuda.bindings import driver as drv

        self.bufs = [torch.empty(capacity, dtype=torch.uint8, device=device) for _ in range(ring)]
        self.buf_ptrs = [b.data_ptr() for b in self.bufs]
        self.kernel = torch.cuda.Stream(device, priority=priority)
        # piece k's DMA goes on dmas[k % len] (one copy stream measured best for H2D)
        self.dmas = [torch.cuda.Stream(device, priority=priority) for _ in range(dmas)]
        self.kernel_h = drv.CUstream(self.kernel.cuda_stream)
        self.dma_h = [drv.CUstream(d.cuda_stream) for d in self.dmas]
        self.dma_raw = [d.cuda_stream for d in self.dmas]  # for the ctypes batch call
        flags = NO_TIMING
        self.filled = [driver_ok(drv.cuEventCreate(flags), "cuEventCreate") for _ in range(ring)]
        self.free = [driver_ok(drv.cuEventCreate(flags), "cuEventCreate") for _ in range(ring)]
        # reused by every job: a stream wait binds to the record made before it, so re-recording
        # for the next job cannot disturb waits already queued (no event created per job)
        # recorded on the compute stream at submit
        self.ready = driver_ok(drv.cuEventCreate(flags), "cuEventCreate")
        self.handover = [driver_ok(drv.cuEventCreate(flags), "cuEventCreate") for _ in range(dmas)]
        self.next = 0
        self.ids = BlockIds(torch, device, self.kernel, ids)
        # (start, end) timing events of reported jobs: a pair is re-recorded only after the job
        # that used it was reported (its elapsed time read), so no job reads a later job's record
        self.timers: list[tuple[Any, Any]] = []
        self.blocking = blocking  # timing events a host thread waits on sleep, never spin

    def take(self) -> int:
        k = self.next
        self.next = (k + 1) % len(self.bufs)
        return k

    def take_timers(self) -> tuple[Any, Any]:
        """A free (start, end) pair; new ones only while more jobs are in flight than ever."""
        if self.timers:
            return self.timers.pop()
        event = self.ids.torch.cuda.Event
        return (
            event(enable_timing=True, blocking=self.blocking),
            event(enable_timing=True, blocking=self.blocking),
        )

    def close(self, destroy: Any) -> None:
        """Release events and buffers (the caller synchronized this pipe's streams)."""
        for ev in (*self.filled, *self.free, self.ready, *self.handover):
            destroy(ev)
        self.ids.close(destroy)
        self.filled, self.free, self.handover, self.bufs, self.timers = [], [], [], [], []
