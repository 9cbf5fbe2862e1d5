"""CudaEngine: staged copies, so PCIe always sees large DMA transfers whatever the KV layout.

Why staged (DESIGN.md "Data path", H100): DMA of scattered 16-32 KiB pieces reaches 5-39 GB/s,
SM copy kernels through the UVA mapping ~51-52 GB/s (92-95% of the 55 GB/s ceiling) and only
~57 GB/s with both directions at once, while large DMA transfers reach the ceiling and ~87 GB/s
full duplex. The pool's slot format is block-major, so a slot run is contiguous in the pool;
only the GPU side is scattered, and HBM (~3 TB/s) absorbs that with a gather/scatter kernel.

Per direction, a ring of ``ring`` (2) staging buffers of ``piece_bytes`` (64 MiB) in GPU memory
(256 MiB in all), a kernel stream and ``dma_streams`` (1) copy streams, chained with events (no
host waits). Defaults chosen on an H100 (docs/BENCHMARKS.md): one copy stream per direction
beat two for H2D; 64 MiB pieces gave the best full-duplex rate; a deeper ring did not help. The
first STORE piece and the last LOAD piece are at most ``edge_bytes`` (16 MiB), so PCIe starts
after a short gather and a load ends soon after its last DMA (8, 16 and 32 MiB measured side by
side: 16 MiB stores 0.3-0.4 GB/s faster at 16-32 KiB pages, loads alike).

- STORE (d2h): waits for an event recorded on the caller's current (compute) stream at
  submit; gather kernel KV -> staging on the gather stream with ``store_ctas`` (8) CTAs of 512
  threads, i.e. at most 8 SMs (of 132 on an H100), in short bursts that run ahead of PCIe by at
  most ``ring`` pieces (measured 352 GB/s, ~6x PCIe, so busy ~15% of the time); then DMA
  staging -> pool on a copy stream (copy engines, no SMs).
- LOAD (h2d): DMA pool -> staging on a high-priority copy stream (no SMs); scatter kernel
  staging -> KV on a high-priority stream with ``load_ctas`` (16) CTAs of 512 threads (measured
  661 GB/s, busy ~8% of the load's time), after an
  event recorded on the compute stream at submit (the target blocks may just have been freed
  by work still queued there).

- LOAD by layer (``submit_layered``, for a request that runs in the same step): no staging.
  One copy kernel per layer, in forward order, reads that layer's bytes of every block straight
  from the pool through its UVA mapping on the load kernel stream with ``layer_ctas`` (8) CTAs,
  and records that layer's event; ``wait_layer`` makes the compute stream wait for it on the GPU
  (the host never waits). Layer L's attention runs while layers L+1.. still cross PCIe, so the
  step costs about max(load, compute), not their sum. All the step's layered loads (one job per
  request) start together (``start_layered``): one kernel per layer over every job's blocks,
  so layer 0 of every request lands first. Why 8 CTAs (measured on an H100,
  a 1.22 GiB load beside 32 layers of Llama-3-8B GEMMs): alone, 4-32 CTAs all load at 47-50
  GB/s; beside a 4,096-token forward the copy CTAs take SMs from the GEMMs, and the forward
  grew by 16 ms with 32 CTAs, 9 with 16, 7 with 8 and 11 with 4 (2 CTAs starve the copy).

Host path (what stands between ``submit()`` and the first DMA): validation against per-layout
limits read once (``BatchValidator``), one sort and the piece cuts (``JobPlan``), then piece 0 is
queued before the DMA runs of the other pieces are built. A piece's DMA runs go to the driver in
one ``cuMemcpyBatchAsync`` (``batch_copy.py``; a ``cuMemcpyAsync`` per run where the driver has
no batch call), so a job's host time no longer grows by ~10 µs per slot run. Nothing is
allocated or created per job: the compute-stream and hand-over events are re-recorded, the
timing events come from a per-pipe free list, the block ids go through persistent pinned and
device buffers (``cuda_ids.BlockIds``), and the compute stream's driver handle is cached per stream.

Completion: a pair of timing events per job (start, end), the end queried by ``poll`` (never
blocks); the pair returns to its pipe's free list once the job is reported. The worker's
completion thread waits in ``wait_for_store`` on the oldest store's end event (stores finish in
submission order): torch's ``Event.synchronize`` releases the GIL, and the store pipe's timing
events are blocking-sync events, so that thread sleeps in the driver instead of spinning a
core. Jobs of one direction complete in submission order; the two directions run
concurrently, touching disjoint slots (the pool never hands a slot to a store while a load
reads it).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvoffload_connector.worker.transfer.batch_copy import BatchCopy, CopyRuns
from kvoffload_connector.worker.transfer.contract import (
    BatchValidator,
    Direction,
    JobResult,
    TransferBatch,
)
from kvoffload_connector.worker.transfer.cuda_driver import NO_TIMING, driver_ok
from kvoffload_connector.worker.transfer.cuda_ids import BlockIds
from kvoffload_connector.worker.transfer.cuda_pipe import Pipe
from kvoffload_connector.worker.transfer.cuda_tables import (
    STAGING_ALIGN,
    group_table,
    layer_stages,
)
from kvoffload_connector.worker.transfer.kernels import CopyKernels
from kvoffload_connector.worker.transfer.plan import JobPlan, Piece

if TYPE_CHECKING:
    import torch

    from kvoffload_connector.worker.layout import CanonicalLayout
    from kvoffload_connector.worker.pool_view import PoolView

__all__ = ["CudaEngine"]


@dataclass
class _Job:
    job_id: int
    nbytes: int
    start: Any  # torch.cuda.Event (timing), owned by the job until it is reported
    end: Any
    pipe: Pipe  # whose free list the two events go back to
    # of the start -> end time, the part this job reports: jobs that share one copy sequence
    # (a step's layered loads) split it by bytes, so their seconds add up to it once
    share: float = 1.0


class CudaEngine:
    """Staged gather/scatter + large DMA; see the module docstring for streams and SM use."""

    def __init__(
        self,
        layout: CanonicalLayout,
        pool: PoolView,
        device: torch.device,
        *,
        piece_bytes: int = 64 << 20,
        ring: int = 2,
        store_ctas: int = 8,
        load_ctas: int = 16,
        layer_ctas: int = 8,
        dma_streams: int = 1,
        edge_bytes: int = 16 << 20,
        batch_copies: bool = True,
    ) -> None:
        import torch

        if device.type != "cuda":
            raise ValueError(f"CudaEngine needs a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if not 1 <= store_ctas <= 8:
            raise ValueError(f"stores use at most 8 CTAs, got {store_ctas}")
        if pool.slot_bytes < layout.slot_bytes:
            raise ValueError(
                f"pool slots of {pool.slot_bytes} bytes < layout's {layout.slot_bytes}"
            )
        for s in layout.storages:
            if s.device != device:
                raise ValueError(f"KV storage on {s.device}, engine on {device}")
        self._torch = torch
        self._device = device
        self._layout = layout
        self._pool = pool
        self._store_ctas = store_ctas
        self._load_ctas = load_ctas
        max_gbb = max(g.block_bytes for g in layout.groups)
        cap = max(piece_bytes, max_gbb)
        self._capacity = -(-cap // STAGING_ALIGN) * STAGING_ALIGN
        # a LOAD writes each GPU block at most once, so this many ids fit any LOAD and most
        # STOREs (a STORE may read a block into several slots: the id buffers then grow once)
        ids = sum(g.num_blocks for g in layout.groups)
        with torch.cuda.device(device):
            self._pipes = {
                Direction.STORE: Pipe(
                    device, self._capacity, ring, 0, dma_streams, ids, blocking=True
                ),
                Direction.LOAD: Pipe(device, self._capacity, ring, -1, dma_streams, ids),
            }
            self._tables = {
                g.group_id: group_table(torch, device, layout, g) for g in layout.groups
            }
            self._stages, self._stage_of = layer_stages(layout, self._tables)
            self._kernels = CopyKernels(device.index, torch.cuda.get_device_capability(device))
        # per-layout constants, read once: submit's host time gates the first copy
        self._validate = BatchValidator(layout)
        self._block_bytes = {gid: t.block_bytes for gid, t in self._tables.items()}
        from cuda.bindings import driver

        self._driver = driver
        # a piece's DMA runs in one driver call where the driver has it (batch_copy.py)
        self._batch = BatchCopy.load(device.index) if batch_copies else None
        self._lock = threading.Lock()
        self._jobs: dict[int, _Job] = {}
        self._done: dict[int, JobResult] = {}
        self._closed = False
        self._edge_bytes = edge_bytes
        self._compute: dict[int, Any] = {}  # raw stream handle -> its CUstream wrapper
        self._layer_ctas = layer_ctas
        # layered loads get their own stream and id buffer: never queued behind staged loads
        with torch.cuda.device(device):
            self._layer_stream = torch.cuda.Stream(device, priority=-1)
            self._layer_ids = BlockIds(torch, device, self._layer_stream, 2 * ids)
        self._layer_stream_h = driver.CUstream(self._layer_stream.cuda_stream)
        self._layer_ready = driver_ok(driver.cuEventCreate(NO_TIMING), "cuEventCreate")
        # one event per stage, re-recorded by each layered load (a stream wait binds to the
        # record made before it); `_layered` says whether this step's forward must wait
        self._stage_events = [
            driver_ok(driver.cuEventCreate(NO_TIMING), "cuEventCreate") for _ in self._stages
        ]
        self._layered = False
        # layered loads submitted for this step, launched together by start_layered
        self._step_loads: list[tuple[int, Sequence[TransferBatch], int]] = []
        # set to [] to record host timestamps of the last submit (benchmarks)
        self.trace: list[tuple[str, float]] | None = None

    # ---- the TransferEngine protocol -------------------------------------------------------

    def submit(self, job_id: int, direction: Direction, batches: Sequence[TransferBatch]) -> None:
        """Validate and enqueue; never waits for the GPU. ValueError on bad input; a pool not
        yet registered, or a CUDA error while enqueuing, gives a failed JobResult."""
        if self.trace is not None:
            self.trace = [("submit", time.perf_counter())]
        nbytes = self._validate(self._pool.slot_count, direction, batches)
        with self._lock:
            enqueue = functools.partial(self._plan_and_enqueue, job_id, direction, batches, nbytes)
            if self._admit(job_id, enqueue, self._refusal(batches)):
                self._mark("enqueued")

    def _plan_and_enqueue(
        self, job_id: int, direction: Direction, batches: Sequence[TransferBatch], nbytes: int
    ) -> _Job:
        self._mark("locked")
        store = direction is Direction.STORE
        # sorted and cut up front; DMA runs of piece 0 first, the rest while it copies
        plan = JobPlan(
            batches,
            self._block_bytes,
            self._pool.slot_bytes,
            self._capacity,
            self._pool.piece_bytes,
            head=self._edge_bytes if store else 0,
            tail=0 if store else self._edge_bytes,
        )
        self._mark("planned")
        return self._enqueue(job_id, direction, plan, nbytes)

    def submit_layered(self, job_id: int, batches: Sequence[TransferBatch]) -> None:
        """A LOAD by layer for this step's forward (see the module docstring), queued until
        ``start_layered`` (or the first ``wait_layer``) launches every layered load of the step
        together. Call ``wait_layer`` from each layer's attention; ``new_step`` before the next
        step. Bad input raises ValueError; an unregistered pool or a CUDA error gives a failed
        JobResult (and nothing for the forward to wait for: the caller reports the blocks as
        load errors)."""
        nbytes = self._validate(self._pool.slot_count, Direction.LOAD, batches)
        with self._lock:
            self._check_id(job_id)
            refusal = self._refusal(batches) or (None if self._stages else "no layer map")
            if refusal is not None:
                self._done[job_id] = JobResult(job_id, False, 0, 0.0, refusal)
                return
            self._step_loads.append((job_id, batches, nbytes))
            self._layered = True

    def start_layered(self) -> None:
        """Launch the layered loads queued since the last call as one sequence: per layer one
        copy kernel over every job's blocks, then that layer's event. Launched one job at a
        time, layer 0 of the step's last job would land only after every earlier job's last
        layer, and the forward's first layer would wait for nearly the whole step's load."""
        with self._lock:
            self._start_layered()

    def _start_layered(self) -> None:
        queued, self._step_loads = self._step_loads, []
        if not queued:
            return
        t0 = time.perf_counter()
        try:
            with self._torch.cuda.device(self._device):
                for job in self._enqueue_layered(queued):
                    self._jobs[job.job_id] = job
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"
            for job_id, _, _ in queued:
                self._jobs.pop(job_id, None)
                self._done[job_id] = JobResult(job_id, False, 0, time.perf_counter() - t0, err)

    def _refusal(self, batches: Sequence[TransferBatch] = ()) -> str | None:
        """Why a job must fail at once (a slot of it not registered with CUDA yet: the pool
        registers in pieces, `PoolView.registered_end`), or None."""
        end = self._pool.registered_end
        if end >= self._pool.slot_count:
            return None
        if end and all(not len(b) or int(b.slots.max()) < end for b in batches):
            return None
        if self._pool.error or not end:
            return self._pool.error or "pool not registered with CUDA (yet)"
        return f"a slot past the {end} registered with CUDA (yet)"

    def _admit(self, job_id: int, enqueue: Callable[[], _Job], refusal: str | None = None) -> bool:
        """Under the lock: raise for a shut-down engine or a job id still in use; otherwise
        queue the job, or record it failed (an unregistered pool, ``refusal``, or an error
        while enqueuing). True when queued."""
        self._check_id(job_id)
        refusal = self._refusal() or refusal
        if refusal is not None:
            self._done[job_id] = JobResult(job_id, False, 0, 0.0, refusal)
            return False
        t0 = time.perf_counter()
        try:
            with self._torch.cuda.device(self._device):
                self._jobs[job_id] = enqueue()
            return True
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"
            self._done[job_id] = JobResult(job_id, False, 0, time.perf_counter() - t0, err)
            return False

    def _check_id(self, job_id: int) -> None:
        """Under the lock: raise for a shut-down engine or a job id still in use."""
        if self._closed:
            raise RuntimeError("engine is shut down")
        if (
            job_id in self._jobs
            or job_id in self._done
            or any(q[0] == job_id for q in self._step_loads)
        ):
            raise ValueError(f"job id {job_id} is still in flight or unreported")

    def wait_layer(self, layer_name: str) -> None:
        """Make the current (compute) stream wait, on the GPU, until this step's layered loads
        have moved ``layer_name``'s bytes (all of them, for a layer the map does not know)."""
        if self._layered:
            self._wait_stage(self._stage_of.get(layer_name, len(self._stages) - 1))

    def wait_all_layers(self) -> None:
        """The stages run in order on one stream: the last stage's event covers them all."""
        if self._layered:
            self._wait_stage(len(self._stages) - 1)

    def _wait_stage(self, stage: int) -> None:
        if self._step_loads:  # a forward waits before the worker started the step's loads
            self.start_layered()
        driver_ok(
            self._driver.cuStreamWaitEvent(self._compute_stream(), self._stage_events[stage], 0),
            "cuStreamWaitEvent",
        )

    def new_step(self) -> None:
        """The next forward has no layered load to wait for until ``submit_layered`` (loads
        queued and never started are started now: they complete and are reported)."""
        if self._step_loads:
            self.start_layered()
        self._layered = False

    def poll(self) -> list[JobResult]:
        with self._lock:
            self._start_layered()
            for job in list(self._jobs.values()):
                if job.end.query():
                    self._finish(job)
            out = list(self._done.values())
            self._done.clear()
        return out

    def wait(self, job_ids: Collection[int]) -> list[JobResult]:
        with self._lock:
            self._start_layered()
            out = []
            for job_id in sorted(set(job_ids)):
                job = self._jobs.get(job_id)
                if job is not None:
                    job.end.synchronize()
                    self._finish(job)
                if job_id in self._done:
                    out.append(self._done.pop(job_id))
            return out

    def wait_for_store(self, timeout_s: float) -> None:
        """Wait out the oldest STORE in flight: stores finish in submission order, so it is
        the next to complete. No timeout on the GPU (a copy ends; ``timeout_s`` is not used):
        the caller's thread blocks in the driver without the GIL. The result stays for poll."""
        with self._lock:
            if self._closed:
                return
            pipe = self._pipes[Direction.STORE]
            job = next((j for j in self._jobs.values() if j.pipe is pipe), None)
        if job is not None:
            # this thread's current device: a runtime call elsewhere would open a context on
            # device 0 in every rank's process
            with self._torch.cuda.device(self._device):
                job.end.synchronize()

    def shutdown(self) -> None:
        with self._lock:
            self._start_layered()
            for job in list(self._jobs.values()):
                job.end.synchronize()
                self._finish(job)
            self._closed = True
            for pipe in self._pipes.values():
                for stream in (pipe.kernel, *pipe.dmas):
                    stream.synchronize()
                pipe.close(self._driver.cuEventDestroy)
            self._layer_stream.synchronize()
            self._layer_ids.close(self._driver.cuEventDestroy)
            for ev in (*self._stage_events, self._layer_ready):
                self._driver.cuEventDestroy(ev)
            self._stage_events = []

    # ---- internals -------------------------------------------------------------------------

    def _mark(self, label: str) -> None:
        if self.trace is not None:
            self.trace.append((label, time.perf_counter()))

    def _finish(self, job: _Job) -> None:
        seconds = job.start.elapsed_time(job.end) / 1e3 * job.share
        self._done[job.job_id] = JobResult(job.job_id, True, job.nbytes, seconds)
        del self._jobs[job.job_id]
        job.pipe.timers.append((job.start, job.end))  # read: free for a later job

    def _compute_stream(self) -> Any:
        """The caller's current stream as a CUstream (it may change between calls: the raw
        handle is read each time, the wrapper built once per handle)."""
        h = self._torch.cuda.current_stream(self._device).cuda_stream
        cu = self._compute.get(h)
        if cu is None:
            cu = self._compute[h] = self._driver.CUstream(h)
        return cu

    def _enqueue(self, job_id: int, direction: Direction, plan: JobPlan, nbytes: int) -> _Job:
        pipe = self._pipes[direction]
        drv = self._driver
        record, wait = drv.cuEventRecord, drv.cuStreamWaitEvent
        kstream = pipe.kernel_h
        driver_ok(record(pipe.ready, self._compute_stream()), "cuEventRecord")
        driver_ok(wait(kstream, pipe.ready, 0), "cuStreamWaitEvent")
        start, end = pipe.take_timers()
        try:
            self._enqueue_pieces(pipe, direction, plan, start, end)
        except BaseException:
            pipe.timers.append((start, end))  # never reported: free again
            raise
        return _Job(job_id, nbytes, start, end, pipe)

    def _enqueue_pieces(
        self, pipe: Pipe, direction: Direction, plan: JobPlan, start: Any, end: Any
    ) -> None:
        drv = self._driver
        record, wait = drv.cuEventRecord, drv.cuStreamWaitEvent
        kstream = pipe.kernel_h
        ids_at = plan.ids_at
        ids_base: list[int] = []

        def ids_ptr(i: int) -> int:
            """Device address of piece i's block ids; uploads the job's ids (known before any
            run list is built) on first use: after the first LOAD DMA is queued, so PCIe starts
            first; before a STORE's first gather, on the kernel stream (see ``BlockIds``)."""
            if not ids_base:
                ids_base.append(pipe.ids.upload(plan.ids, kstream))
            return ids_base[0] + 8 * int(ids_at[i])

        store = direction is Direction.STORE
        if store:
            start.record(pipe.kernel)
        else:
            start.record(pipe.dmas[0])
            for d in pipe.dmas[1:]:
                d.wait_event(start)
        self._mark("started")
        base = self._pool.base_ptr
        for i in range(len(plan)):
            p = plan.piece(i)
            k = pipe.take()
            buf = pipe.buf_ptrs[k]
            d = k % len(pipe.dma_h)
            dstream = pipe.dma_h[d]
            if store:
                driver_ok(wait(kstream, pipe.free[k], 0), "cuStreamWaitEvent")
                self._copy_kernel(p, ids_ptr(i), buf, kstream, True, self._store_ctas)
                driver_ok(record(pipe.filled[k], kstream), "cuEventRecord")
                driver_ok(wait(dstream, pipe.filled[k], 0), "cuStreamWaitEvent")
                self._dma(p.runs, base, buf, True, dstream, pipe.dma_raw[d])
                driver_ok(record(pipe.free[k], dstream), "cuEventRecord")
            else:
                driver_ok(wait(dstream, pipe.free[k], 0), "cuStreamWaitEvent")
                self._dma(p.runs, base, buf, False, dstream, pipe.dma_raw[d])
                driver_ok(record(pipe.filled[k], dstream), "cuEventRecord")
                driver_ok(wait(kstream, pipe.filled[k], 0), "cuStreamWaitEvent")
                self._copy_kernel(p, ids_ptr(i), buf, kstream, False, self._load_ctas)
                driver_ok(record(pipe.free[k], kstream), "cuEventRecord")
            if i == 0:
                self._mark("first piece")
        # the job ends when every stream of its pipe has drained its work
        streams = [kstream, *pipe.dma_h]
        tail = pipe.dma_h[0] if store else kstream
        others = [st for st in streams if st is not tail]
        for ev, other in zip(pipe.handover, others, strict=True):
            driver_ok(record(ev, other), "cuEventRecord")
            driver_ok(wait(tail, ev, 0), "cuStreamWaitEvent")
        end.record(pipe.dmas[0] if store else pipe.kernel)

    def _dma(
        self, runs: np.ndarray, base: int, buf: int, to_pool: bool, stream: Any, raw: int
    ) -> None:
        """A piece's DMA runs (pool offset, staging offset, bytes) between the pool at ``base``
        and the staging buffer ``buf``: one batch call, or one cuMemcpyAsync per run."""
        if self._batch is not None and len(runs) > 1:
            self._batch(CopyRuns.of(runs, base, buf, to_pool), to_pool, raw)
            return
        memcpy = self._driver.cuMemcpyAsync
        for pool_off, stg_off, n in runs.tolist():
            dst, src = (
                (base + pool_off, buf + stg_off) if to_pool else (buf + stg_off, base + pool_off)
            )
            err = memcpy(dst, src, n, stream)[0]
            if int(err):
                raise RuntimeError(f"cuMemcpyAsync failed: {err!r}")

    def _enqueue_layered(
        self, queued: list[tuple[int, Sequence[TransferBatch], int]]
    ) -> list[_Job]:
        pipe = self._pipes[Direction.LOAD]  # lends its timing events
        drv = self._driver
        kstream = self._layer_stream_h
        # the target blocks may just have been freed by work still queued on the compute stream
        driver_ok(drv.cuEventRecord(self._layer_ready, self._compute_stream()), "cuEventRecord")
        driver_ok(drv.cuStreamWaitEvent(kstream, self._layer_ready, 0), "cuStreamWaitEvent")
        timers = [pipe.take_timers() for _ in queued]
        for start, _ in timers:
            start.record(self._layer_stream)
        # per group, every job's blocks: block ids then each block's pool address, one upload
        by_group: dict[int, list[TransferBatch]] = {}
        for _, batches, _ in queued:
            for b in batches:
                if len(b):
                    by_group.setdefault(b.group, []).append(b)
        parts, spans = [], {}
        at = 0
        for group, bs in by_group.items():
            blocks = np.concatenate([b.gpu_blocks for b in bs])
            addrs = np.concatenate(
                [
                    self._pool.base_ptr
                    + b.slots * self._pool.slot_bytes
                    + b.slot_block_index * self._block_bytes[group]
                    for b in bs
                ]
            )
            spans[group] = (at, len(blocks))
            parts += [blocks, addrs]
            at += 2 * len(blocks)
        ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        dev = self._layer_ids.upload(ids, kstream)
        for k, st in enumerate(self._stages):
            span = spans.get(st.group)
            if span is not None:
                first, n = span
                work = n * st.n_regions * st.units_per_region
                grid = max(1, min(self._layer_ctas, -(-work // (512 // 32))))
                self._kernels.launch(
                    st.width,
                    grid,
                    kstream,
                    dev + 8 * first,
                    n,
                    st.regions.data_ptr(),
                    st.n_regions,
                    st.units_per_region,
                    0,
                    0,
                    False,
                    dev + 8 * (first + n),
                )
            driver_ok(drv.cuEventRecord(self._stage_events[k], kstream), "cuEventRecord")
        for _, end in timers:
            end.record(self._layer_stream)
        total = sum(nbytes for _, _, nbytes in queued) or 1
        return [
            _Job(job_id, nbytes, start, end, pipe, nbytes / total)
            for (job_id, _, nbytes), (start, end) in zip(queued, timers, strict=True)
        ]

    def _copy_kernel(
        self, p: Piece, ids_ptr: int, buf: int, stream: Any, to_staging: bool, ctas: int
    ) -> None:
        t = self._tables[p.group]
        n = len(p.gpu_blocks)
        work = n * t.n_regions * t.units_per_region  # warp units
        grid = max(1, min(ctas, -(-work // (512 // 32))))
        self._kernels.launch(
            t.width,
            grid,
            stream,
            ids_ptr,
            n,
            t.regions.data_ptr(),
            t.n_regions,
            t.units_per_region,
            buf,
            t.block_bytes,
            to_staging,
        )
