"""CudaEngine.wait_for_store: a thread beside the engine's steps waits for a store to finish,
neither holding the GIL nor spinning a core, and the result stays for `poll`.

What the worker's completion thread relies on to commit a store whose copy finished while no
engine step runs (worker.py).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from kvoffload_connector.worker.transfer import Direction, TransferBatch
from test_transfer_gpu import build, pools, small_engine  # noqa: F401 - the fixture

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _store(layout, slots: int, blocks: int) -> list[TransferBatch]:
    g = layout.groups[0]
    n = min(blocks, g.num_blocks, slots * layout.chunk_blocks)
    ids = np.arange(n, dtype=np.int64)
    return [TransferBatch(g.group_id, ids, ids // layout.chunk_blocks, ids % layout.chunk_blocks)]


def test_wait_for_store_returns_once_a_store_finished_without_holding_the_gil(pools):  # noqa: F811
    _, layout, pool = build("LBHNC", pools, chunk_blocks=4, slot_count=40, num_blocks=160,
                            heads=8, block_size=16, head_size=128)  # fmt: skip
    engine = small_engine(layout, pool, blocks_per_piece=8)
    try:
        # a long GPU queue ahead of the store: the store's copy waits behind it
        x = torch.randn(4096, 4096, device="cuda")
        for _ in range(200):
            x = x @ x
            x = x / x.norm()
        engine.submit(1, Direction.STORE, _store(layout, 40, 160))
        ticks = 0
        waited = threading.Event()
        cpu0 = [0.0]

        def waiter() -> None:
            t0 = time.thread_time()
            engine.wait_for_store(5.0)
            cpu0[0] = time.thread_time() - t0
            waited.set()

        t = threading.Thread(target=waiter)
        start = time.perf_counter()
        t.start()
        while not waited.is_set():  # this thread keeps running Python: the GIL is free
            ticks += 1
            if ticks % 1000 == 0:
                time.sleep(0)
        wall = time.perf_counter() - start
        t.join()
        results = engine.poll()
        assert [r.job_id for r in results] == [1] and results[0].ok, results
        assert engine.poll() == []  # reported once
        assert wall > 0.01, f"the store finished too soon to tell ({wall * 1e3:.1f} ms)"
        assert ticks > 10_000, f"the main thread got the GIL {ticks} times in {wall:.3f} s"
        # a blocking-sync event: the waiting thread sleeps in the driver instead of spinning
        assert cpu0[0] < 0.5 * wall, f"waiter used {cpu0[0]:.3f} s CPU in {wall:.3f} s"
        print(f"waited {wall * 1e3:.1f} ms, waiter CPU {cpu0[0] * 1e3:.1f} ms, {ticks} ticks")
        # nothing in flight: returns at once
        t0 = time.perf_counter()
        engine.wait_for_store(5.0)
        assert time.perf_counter() - t0 < 0.1
    finally:
        engine.shutdown()
