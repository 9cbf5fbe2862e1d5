"""CudaEngine on a real GPU: bit-exact round trips through a registered shared-memory pool."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from kvoffload_connector.worker.layout import canonicalize
from kvoffload_connector.worker.pool_view import PoolView
from kvoffload_connector.worker.transfer import Direction, TransferBatch, make_engine
from kvoffload_connector.worker.transfer.cpu import CpuTorchEngine

from tests.connector.kv_setup import (
    KIND_NAMES,
    POISON,
    expected_block,
    fill_random,
    make_kv_caches,
    round_trip,
    write_block,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture
def pools(tmp_path):
    """Open and CUDA-register PoolViews over files in /dev/shm (the sidecar's emptyDir)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    made = []

    def make(slot_bytes: int, slot_count: int, register: bool = True) -> PoolView:
        path = os.path.join(base, f"kvoffload-gpu-{os.getpid()}-{len(made)}.shm")
        with open(path, "wb") as f:
            f.truncate(slot_bytes * slot_count)
        view = PoolView.open(path, 0, slot_bytes, slot_count)
        made.append((view, path))
        if register:
            view.start_device_registration(torch.device("cuda"))
            assert view.wait_ready(60), view.error
        return view

    yield make
    for view, path in made:
        view.close()
        os.unlink(path)


def build(kind, pools, chunk_blocks=4, slot_count=40, **kw):
    kw.setdefault("num_blocks", 64)
    setup = make_kv_caches(kind, device="cuda", **kw)
    layout = canonicalize(setup.kv_caches, setup.layer_groups, chunk_blocks, setup.kv_cache_config)
    return setup, layout, pools(layout.slot_bytes, slot_count)


def small_engine(layout, pool, blocks_per_piece=3, dma_streams=1, batch_copies=True):
    """Staging pieces of a few blocks and a ring of 2: many pieces, ring reuse in every job."""
    from kvoffload_connector.worker.transfer.cuda import CudaEngine

    gbb = max(g.block_bytes for g in layout.groups)
    return CudaEngine(
        layout,
        pool,
        torch.device("cuda"),
        piece_bytes=blocks_per_piece * gbb,
        ring=2,
        dma_streams=dma_streams,
        batch_copies=batch_copies,
    )


@pytest.mark.parametrize("kind", KIND_NAMES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float8_e4m3fn"])
def test_round_trip_every_kind_and_dtype(kind, dtype, pools):
    setup, layout, pool = build(kind, pools, groups=2, shared=True, heads=3, dtype=dtype)
    engine = small_engine(layout, pool, dma_streams=1 + len(dtype) % 2)
    try:
        rng = random.Random(hash((kind, dtype)) & 0xFFFF)
        for _ in range(3):
            round_trip(setup, layout, pool, engine, rng, max_blocks=12)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kind", ["LBHNC", "BLHNC"])
def test_batched_and_per_run_dma_write_the_same_pool_bytes(kind, pools):
    """The same jobs through one cuMemcpyBatchAsync per piece and through one cuMemcpyAsync
    per run: identical pool bytes after the stores, bit-exact loads from both."""
    setup, layout, pool = build(kind, pools, groups=2, heads=3, dtype="bfloat16")
    batched = small_engine(layout, pool, blocks_per_piece=5)
    per_run = small_engine(layout, pool, blocks_per_piece=5, batch_copies=False)
    try:
        assert batched._batch is not None, "this driver has no cuMemcpyBatchAsync"
        assert per_run._batch is None
        for seed in range(3):
            snaps = []
            for engine in (batched, per_run):
                pool.tensor.fill_(POISON)
                round_trip(setup, layout, pool, engine, random.Random(seed), max_blocks=16)
                snaps.append(pool.tensor.clone())
            assert torch.equal(*snaps)
    finally:
        batched.shutdown()
        per_run.shutdown()


@pytest.mark.parametrize("kind", KIND_NAMES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_layered_round_trip_every_kind(kind, dtype, pools):
    setup, layout, pool = build(kind, pools, groups=2, shared=True, heads=3, dtype=dtype)
    engine = small_engine(layout, pool)
    try:
        rng = random.Random(hash(("layered", kind, dtype)) & 0xFFFF)
        for _ in range(3):
            round_trip(setup, layout, pool, engine, rng, max_blocks=12, layered=True)
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "wait_all, jobs",
    [(False, 1), (True, 1), (False, 4), (True, 3)],
    ids=["per-layer", "whole-step", "per-layer-4-jobs", "whole-step-3-jobs"],
)
def test_layered_load_each_layer_is_in_place_when_its_wait_returns(pools, wait_all, jobs):
    """Work queued on the compute stream right after wait_layer(L) sees all of layer L's bytes,
    while later layers may still be in flight: snapshots taken per layer on the compute stream
    (no host sync in between) equal the pool's bytes. With wait_all_layers (a forward that may
    replay a full CUDA graph), one wait before the first layer covers every layer. Several
    requests' loads in one step (one job each) start together, layer by layer, and each job
    reports its own bytes."""
    setup, layout, pool = build(
        "LBHNC",
        pools,
        num_layers=12,
        num_blocks=512,
        heads=8,
        head_size=128,
        block_size=16,
        slot_count=160,
    )
    engine = make_engine(layout, pool, torch.device("cuda"))
    try:
        rng = random.Random(7)
        slots = rng.sample(range(pool.slot_count), 120)
        blocks = rng.sample(range(512), 480)
        batch = TransferBatch(
            0,
            np.array(blocks),
            np.repeat(np.array(slots), 4),
            np.tile(np.arange(4), 120),
        )
        pool.tensor.copy_(torch.randint(0, 255, pool.tensor.shape, dtype=torch.uint8))
        for t in setup.kv_caches.values():
            t.view(torch.uint8).fill_(POISON)
        torch.cuda.synchronize()
        engine.new_step()
        cuts = np.linspace(0, 480, jobs + 1).astype(int)
        for j in range(jobs):
            a, b = cuts[j], cuts[j + 1]
            part = TransferBatch(
                0, batch.gpu_blocks[a:b], batch.slots[a:b], batch.slot_block_index[a:b]
            )
            engine.submit_layered(1 + j, [part])
        engine.start_layered()
        snaps = {}
        if wait_all:
            engine.wait_all_layers()
        for name, _, _ in layout.layers:
            if not wait_all:
                engine.wait_layer(name)
            snaps[name] = setup.kv_caches[name].clone()  # on the compute stream
        results = engine.wait(range(1, jobs + 1))
        gbb = layout.group(0).block_bytes
        assert [(r.job_id, r.ok, r.bytes) for r in results] == [
            (1 + j, True, int(cuts[j + 1] - cuts[j]) * gbb) for j in range(jobs)
        ]
        torch.cuda.synchronize()
        for name, snap in snaps.items():
            got, final = snap.contiguous().view(torch.uint8), setup.kv_caches[name].contiguous()
            assert torch.equal(got, final.view(torch.uint8)), f"{name} read before it landed"
        for i in range(0, 480, 8):
            blk, slot, pos = blocks[i], batch.slots[i], batch.slot_block_index[i]
            want = pool.tensor[slot, pos * gbb : (pos + 1) * gbb].numpy()
            assert np.array_equal(expected_block(setup, layout, 0, blk), want)
    finally:
        engine.shutdown()


def test_queued_layered_loads_run_even_if_nothing_waits_for_them(pools):
    """A step whose forward never waits (its loads queued, no start_layered, no wait_layer)
    still runs them at new_step and reports them; a queued job's id is still in use."""
    setup, layout, pool = build("LBHNC", pools, num_blocks=64, slot_count=40)
    engine = small_engine(layout, pool)
    try:
        fill_random(layout, seed=11)
        pool.tensor.copy_(torch.randint(0, 255, pool.tensor.shape, dtype=torch.uint8))
        gbb = layout.group(0).block_bytes
        batch = TransferBatch(0, np.arange(8), np.repeat(np.arange(2), 4), np.tile(np.arange(4), 2))
        other = TransferBatch(0, np.arange(8, 12), np.full(4, 5), np.arange(4))
        engine.new_step()
        engine.submit_layered(1, [batch])
        engine.submit_layered(2, [other])
        with pytest.raises(ValueError, match="still in flight"):
            engine.submit_layered(2, [other])
        engine.new_step()  # nothing waited: the queued loads start here
        results = engine.wait([1, 2])
        assert [(r.job_id, r.ok, r.bytes) for r in results] == [
            (1, True, 8 * gbb),
            (2, True, 4 * gbb),
        ]
        for b in (batch, other):
            for blk, slot, pos in zip(b.gpu_blocks, b.slots, b.slot_block_index, strict=True):
                want = pool.tensor[slot, pos * gbb : (pos + 1) * gbb].numpy()
                assert np.array_equal(expected_block(setup, layout, 0, int(blk)), want)
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "params",
    [
        {"kind": "LBNHC", "heads": 5, "pad": 48, "head_size": 24},  # 8-byte vectors
        {"kind": "BLHNC", "heads": 7, "dtype": "float8_e4m3fn", "head_size": 3},  # odd bytes
        {"kind": "LBHNC", "kernel_split": 2, "block_size": 16},
        {"kind": "LHBNC", "heads": 1, "num_layers": 5},
    ],
)
def test_round_trip_odd_geometry(params, pools):
    params = dict(params)
    setup, layout, pool = build(params.pop("kind"), pools, chunk_blocks=5, **params)
    engine = make_engine(layout, pool, torch.device("cuda"))
    try:
        rng = random.Random(3)
        for _ in range(3):
            round_trip(setup, layout, pool, engine, rng)
    finally:
        engine.shutdown()


def test_matches_the_reference_engine(pools):
    setup, layout, pool = build("LBHNC", pools, groups=2, num_layers=4)
    fill_random(layout, seed=9)
    rng = random.Random(9)
    from tests.connector.kv_setup import random_batches

    batches = random_batches(layout, pool.slot_count, rng, max_blocks=20)
    pool.tensor.fill_(POISON)
    ref = CpuTorchEngine(layout, pool, inline=True)
    ref.submit(1, Direction.STORE, batches)
    assert ref.poll()[0].ok
    want = pool.tensor.clone()
    pool.tensor.fill_(POISON)
    engine = small_engine(layout, pool)
    engine.submit(1, Direction.STORE, batches)
    [res] = engine.wait([1])
    engine.shutdown()
    assert res.ok and res.seconds > 0
    assert torch.equal(want, pool.tensor)


def test_store_runs_after_the_compute_stream(pools):
    """A STORE submitted while the compute stream is still writing the blocks stores the
    values written, not the earlier ones."""
    setup, layout, pool = build("BLHNC", pools)
    fill_random(layout, seed=1)
    storage = layout.storages[0]
    engine = small_engine(layout, pool)
    blocks = np.arange(8)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the current stream
    storage.fill_(0x33)  # queued behind the sleep
    engine.submit(1, Direction.STORE, [TransferBatch(0, blocks, blocks // 4, blocks % 4)])
    [res] = engine.wait([1])
    engine.shutdown()
    assert res.ok
    gbb = layout.groups[0].block_bytes
    assert (pool.tensor[:2, : 4 * gbb].numpy() == 0x33).all()


def test_back_to_back_stores_each_wait_for_the_compute_queued_before_them(pools):
    """The compute-stream event is reused by every job of a pipe: job 2's STORE waits for the
    work queued before its own submit (a write behind a ~0.1 s sleep), job 1's for none of
    it; the trace shows piece 0 queued before the job is fully enqueued."""
    setup, layout, pool = build("LBHNC", pools, num_layers=4)
    storage = layout.storages[0]
    engine = small_engine(layout, pool, blocks_per_piece=2, dma_streams=2)
    try:
        storage.fill_(0x11)
        torch.cuda.synchronize()
        first, second = np.arange(8), np.arange(8, 16)
        engine.trace = []
        engine.submit(1, Direction.STORE, [TransferBatch(0, first, first // 4, first % 4)])
        labels = [label for label, _ in engine.trace]
        assert labels.index("first piece") < labels.index("enqueued")
        engine.trace = None
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the current stream
        storage.fill_(0x44)  # queued behind the sleep, after job 1's submit
        engine.submit(2, Direction.STORE, [TransferBatch(0, second, second // 4, second % 4)])
        results = engine.wait([1, 2])
        assert [r.ok for r in results] == [True, True]
    finally:
        engine.shutdown()
    gbb = layout.groups[0].block_bytes
    assert (pool.tensor[:2, : 4 * gbb].numpy() == 0x11).all()
    assert (pool.tensor[2:4, : 4 * gbb].numpy() == 0x44).all()


def test_concurrent_loads_and_stores_on_neighbouring_slots_never_mix(pools):
    """Stores into odd slots while loads read even slots (the same pages), several jobs in
    flight in both directions; every byte ends where it belongs."""
    setup, layout, pool = build("LBHNC", pools, num_blocks=256, num_layers=4, slot_count=64)
    engine = small_engine(layout, pool, blocks_per_piece=5, dma_streams=2)
    cb = layout.chunk_blocks
    gbb = layout.groups[0].block_bytes
    try:
        fill_random(layout, seed=2)
        pool.tensor.fill_(POISON)
        # phase 1: blocks 0..63 into even slots 0, 2, .., 30
        a_blocks = np.arange(64)
        a_slots = 2 * (a_blocks // cb)
        engine.submit(0, Direction.STORE, [TransferBatch(0, a_blocks, a_slots, a_blocks % cb)])
        assert engine.wait([0])[0].ok
        a_data = {int(b): expected_block(setup, layout, 0, int(b)) for b in a_blocks}
        fill_random(layout, seed=3)  # new KV everywhere
        b_blocks = np.arange(64, 128)
        b_data = {int(b): expected_block(setup, layout, 0, int(b)) for b in b_blocks}
        c_blocks = np.arange(128, 192)  # load targets
        jobs = []
        for j in range(4):
            sl = slice(16 * j, 16 * j + 16)
            bb = b_blocks[sl]
            engine.submit(
                10 + j,
                Direction.STORE,
                [TransferBatch(0, bb, 2 * ((bb - 64) // cb) + 1, (bb - 64) % cb)],
            )
            engine.submit(
                20 + j,
                Direction.LOAD,
                [TransferBatch(0, c_blocks[sl], a_slots[sl], a_blocks[sl] % cb)],
            )
            jobs += [10 + j, 20 + j]
        results = engine.wait(jobs)
        assert sorted(r.job_id for r in results) == sorted(jobs) and all(r.ok for r in results)
        for b in a_blocks:
            slot, pos = 2 * (b // cb), b % cb
            assert np.array_equal(pool.tensor[slot, pos * gbb : (pos + 1) * gbb].numpy(), a_data[b])
            assert np.array_equal(expected_block(setup, layout, 0, int(b) + 128), a_data[int(b)])
        for b in b_blocks:
            slot, pos = 2 * ((b - 64) // cb) + 1, (b - 64) % cb
            assert np.array_equal(pool.tensor[slot, pos * gbb : (pos + 1) * gbb].numpy(), b_data[b])
    finally:
        engine.shutdown()


def test_unregistered_pool_fails_the_job_not_the_process(pools):
    setup, layout, _ = build("LBHNC", pools)
    pool = pools(layout.slot_bytes, 8, register=False)  # registration never started
    assert not pool.registered
    engine = small_engine(layout, pool)
    engine.submit(1, Direction.LOAD, [TransferBatch(0, [1], [0], [0])])
    [res] = engine.poll()
    engine.shutdown()
    assert not res.ok and "not registered" in res.error


def test_large_job_many_pieces_full_ring(pools):
    """A 1,024-block (256 MiB) job through the default engine (32 MiB pieces, ring of 3)."""
    setup, layout, pool = build(
        "BLHNC",
        pools,
        num_blocks=1024,
        num_layers=8,
        heads=8,
        head_size=64,
        block_size=16,
        slot_count=300,
    )
    engine = make_engine(layout, pool, torch.device("cuda"))
    try:
        fill_random(layout, seed=4)
        pool.tensor.fill_(POISON)
        perm = np.random.default_rng(4).permutation(1024)
        slots = np.random.default_rng(5).permutation(300)[:256]
        batch = TransferBatch(0, perm, np.repeat(slots, 4), np.tile(np.arange(4), 256))
        engine.submit(1, Direction.STORE, [batch])
        [region] = layout.groups[0].regions  # block-major: one region per block
        blocks = layout.storages[0][region.offset : region.offset + 1024 * region.block_stride]
        before = blocks.clone()
        assert engine.wait([1])[0].ok  # a slot is loaded only once its store is committed
        blocks.fill_(POISON)
        engine.submit(2, Direction.LOAD, [batch])
        [res] = engine.wait([2])
        assert res.ok and res.bytes == 1024 * layout.groups[0].block_bytes
        assert torch.equal(before, blocks)
    finally:
        engine.shutdown()


def _store_jobs(rng, blocks, positions, sizes, cb):
    """Split (block, slot position) pairs into jobs of ``sizes`` entries, each job as one or two
    batches of group 0 (two batches: the job's ids are concatenated before the upload)."""
    jobs, at = [], 0
    for n in sizes:
        b, p = blocks[at : at + n], positions[at : at + n]
        at += n
        cut = rng.randrange(1, n) if n > 1 and rng.random() < 0.5 else n
        parts = [(b[:cut], p[:cut]), (b[cut:], p[cut:])]
        jobs.append([TransferBatch(0, bb, pp // cb, pp % cb) for bb, pp in parts if len(bb)])
    return jobs


def _pool_block(pool, gbb, cb, position):
    slot, pos = divmod(int(position), cb)
    return pool.tensor[slot, pos * gbb : (pos + 1) * gbb].numpy()


def test_back_to_back_jobs_of_varying_sizes_reuse_the_id_buffers(pools):
    """Rounds of store and load jobs of 1..64 blocks, submitted back to back (a dozen in flight
    in both directions), each with its own block-id permutation: every job reads the ids it
    was given although the pinned and device id buffers and the timing events are reused, and
    each job's time is its own (positive, within the round's wall time)."""
    import time

    setup, layout, pool = build("LBHNC", pools, num_blocks=256, num_layers=4, slot_count=64)
    engine = small_engine(layout, pool, blocks_per_piece=5, dma_streams=2)
    cb, gbb = layout.chunk_blocks, layout.groups[0].block_bytes
    half = 32 * cb  # slot positions 0..127 (slots 0..31) and 128..255 (slots 32..63)
    rng = random.Random(11)
    nprng = np.random.default_rng(11)
    sizes_a = [1, 37, 5, 64, 2, 19]  # 128 blocks
    sizes_b = [64, 1, 30, 3, 17, 13]
    ids_cap = {d: engine._pipes[d].ids.capacity for d in Direction}
    job_id = 0
    try:
        for rnd in range(3):
            fill_random(layout, seed=20 + rnd)
            pool.tensor.fill_(POISON)
            src = nprng.permutation(128)  # blocks 0..127: store sources
            data = {int(b): expected_block(setup, layout, 0, int(b)) for b in src}
            # phase 1: stores of blocks 0..127 into positions 0..127, all in flight at once
            pos1 = nprng.permutation(half)
            ids = []
            for batches in _store_jobs(rng, src, pos1, sizes_a if rnd % 2 else sizes_b, cb):
                job_id += 1
                engine.submit(job_id, Direction.STORE, batches)
                ids.append(job_id)
            assert all(r.ok for r in engine.wait(ids))
            for b, p in zip(src, pos1, strict=True):
                assert np.array_equal(_pool_block(pool, gbb, cb, p), data[int(b)]), (rnd, b, p)
            # phase 2, both directions in flight: loads of positions 0..127 into poisoned
            # blocks 128..255 (a new permutation), stores of blocks 0..127 into 128..255
            targets = 128 + nprng.permutation(128)
            for t in targets:
                write_block(setup, layout, 0, int(t), np.full(gbb, POISON, np.uint8))
            pos2 = half + nprng.permutation(half)
            src2 = nprng.permutation(128)
            loads = _store_jobs(rng, targets, pos1, sizes_b if rnd % 2 else sizes_a, cb)
            stores = _store_jobs(rng, src2, pos2, sizes_a, cb)
            ids = []
            t0 = time.perf_counter()
            for ld, st in zip(loads, stores, strict=True):
                engine.submit(job_id + 1, Direction.LOAD, ld)
                engine.submit(job_id + 2, Direction.STORE, st)
                ids += [job_id + 1, job_id + 2]
                job_id += 2
            results = engine.wait(ids)
            wall = time.perf_counter() - t0
            assert sorted(r.job_id for r in results) == ids and all(r.ok for r in results)
            assert all(0 < r.seconds <= wall for r in results), [r.seconds for r in results]
            for t, b in zip(targets, src, strict=True):  # src[i] was stored at pos1[i]
                assert np.array_equal(expected_block(setup, layout, 0, int(t)), data[int(b)])
            for b, p in zip(src2, pos2, strict=True):
                assert np.array_equal(_pool_block(pool, gbb, cb, p), data[int(b)]), (rnd, b, p)
        for d in Direction:
            pipe = engine._pipes[d]
            assert pipe.ids.capacity == ids_cap[d]  # no job outgrew the first device buffer
            # uploads finish in stream order, so the ring grows only when all of it is busy
            assert pipe.ids.host_buffers <= 1 + len(sizes_a)
            # 18 (LOAD) or 36 (STORE) jobs, at most 6 of a pipe in flight: timing pairs reused
            assert 1 <= len(pipe.timers) <= len(sizes_a)
    finally:
        engine.shutdown()


def test_jobs_queued_behind_compute_keep_their_ids_and_outgrow_the_buffers(pools):
    """STOREs queued while the compute stream sleeps (~0.1 s): no upload of theirs can run
    yet, so each takes a fresh pinned buffer instead of overwriting a pending one; one job
    reads blocks into more slot positions than the GPU has blocks (more ids than the first
    buffers hold), so the device buffer grows while earlier kernels that read the old one are
    still queued. Every position gets its own block's bytes; a LOAD then reads them back."""
    setup, layout, pool = build("BLHNC", pools, num_blocks=24, num_layers=3, slot_count=64)
    engine = small_engine(layout, pool, blocks_per_piece=4)
    cb, gbb = layout.chunk_blocks, layout.groups[0].block_bytes
    nprng = np.random.default_rng(12)
    pipe = engine._pipes[Direction.STORE]
    first_cap = pipe.ids.capacity
    assert first_cap == 24
    sizes = [7, 3, 24, 150, 1, 20]  # 205 positions of 256; the 150-block job outgrows 24 ids
    try:
        fill_random(layout, seed=12)
        pool.tensor.fill_(POISON)
        data = {b: expected_block(setup, layout, 0, b) for b in range(24)}
        blocks = nprng.integers(0, 24, size=sum(sizes))  # a STORE may read one block twice
        positions = nprng.permutation(64 * cb)[: sum(sizes)]
        jobs = _store_jobs(random.Random(12), blocks, positions, sizes, cb)
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # every STORE below waits for this
        for i, batches in enumerate(jobs):
            engine.submit(i, Direction.STORE, batches)
        assert pipe.ids.host_buffers >= len(jobs)  # none was free to refill
        assert pipe.ids.capacity >= 150 > first_cap
        results = engine.wait(range(len(jobs)))
        assert [r.ok for r in results] == [True] * len(jobs)
        for b, p in zip(blocks, positions, strict=True):
            assert np.array_equal(_pool_block(pool, gbb, cb, p), data[int(b)]), (b, p)
        # read 24 of the stored positions back into all 24 (poisoned) blocks
        srcs = [(int(b), int(p)) for b, p in zip(blocks[:24], positions[:24], strict=True)]
        for t in range(24):
            write_block(setup, layout, 0, t, np.full(gbb, POISON, np.uint8))
        pos = np.array([p for _, p in srcs])
        engine.submit(100, Direction.LOAD, [TransferBatch(0, np.arange(24), pos // cb, pos % cb)])
        [res] = engine.wait([100])
        assert res.ok
        for t, (b, _) in enumerate(srcs):
            assert np.array_equal(expected_block(setup, layout, 0, t), data[b]), t
    finally:
        engine.shutdown()
