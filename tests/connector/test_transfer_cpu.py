"""CpuTorchEngine: bit-exact round trips for every layout, refusals that change nothing."""

from __future__ import annotations

import os
import random
import re

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
)


@pytest.fixture
def pool_factory(tmp_path):
    """Open PoolViews over real files (in /dev/shm when present); closes them afterwards."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    made = []

    def make(slot_bytes: int, slot_count: int) -> PoolView:
        path = os.path.join(base, f"kvoffload-cpu-{os.getpid()}-{len(made)}-{id(tmp_path)}.shm")
        with open(path, "wb") as f:
            f.truncate(slot_bytes * slot_count + 8192)
        view = PoolView.open(path, 4096, slot_bytes, slot_count)
        made.append((view, path))
        return view

    yield make
    for view, path in made:
        view.close()
        os.unlink(path)


def build(kind, pool_factory, chunk_blocks=4, slot_count=24, **kw):
    kw.setdefault("num_blocks", 24)
    setup = make_kv_caches(kind, **kw)
    layout = canonicalize(setup.kv_caches, setup.layer_groups, chunk_blocks, setup.kv_cache_config)
    pool = pool_factory(layout.slot_bytes, slot_count)
    return setup, layout, pool


@pytest.mark.parametrize("kind", KIND_NAMES)
@pytest.mark.parametrize("inline", [False, True])
def test_round_trip_every_kind(kind, inline, pool_factory):
    setup, layout, pool = build(kind, pool_factory, groups=2, shared=True, heads=3)
    engine = CpuTorchEngine(layout, pool, inline=inline)
    try:
        rng = random.Random(hash((kind, inline)) & 0xFFFF)
        for _ in range(3):
            assert round_trip(setup, layout, pool, engine, rng) > 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_layered_load_round_trip_every_kind(kind, pool_factory):
    setup, layout, pool = build(kind, pool_factory, groups=2, shared=True, heads=3)
    engine = CpuTorchEngine(layout, pool)
    try:
        rng = random.Random(hash(("layered", kind)) & 0xFFFF)
        for _ in range(2):
            assert round_trip(setup, layout, pool, engine, rng, layered=True) > 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_layer_map_covers_every_region_in_forward_order(kind, pool_factory):
    setup, layout, _ = build(kind, pool_factory, groups=2, heads=3, num_layers=11)
    names = [name for name, _, _ in layout.layers]
    assert sorted(names) == sorted(setup.kv_caches)
    order = [tuple(map(int, m.groups())) for n in names if (m := re.match(r"g(\d+)\.l(\d+)$", n))]
    assert order == sorted(order)  # "l10" after "l9": the forward's order
    assert kind == "crosslayer" or len(order) == 2 * 11
    for g in layout.groups:
        held = [set(r) for _, gid, r in layout.layers if gid == g.group_id]
        assert all(held), "a layer without regions"
        assert set().union(*held) == set(range(len(g.regions)))
        if layout.tag.startswith("LB"):  # layer-major: each layer its own regions (block-major
            # layouts merge a block's layers into shared regions: a layered load moves them
            # with the first layer that needs them)
            assert all(a.isdisjoint(b) for i, a in enumerate(held) for b in held[i + 1 :])


@pytest.mark.parametrize(
    "params",
    [
        {"kind": "LBNHC", "dtype": "bfloat16", "heads": 5, "pad": 32},
        {"kind": "BLHNC", "dtype": "float8_e4m3fn", "heads": 7, "head_size": 24},
        {"kind": "LBHNC", "kernel_split": 2, "block_size": 8},
        {"kind": "LHBNC", "dtype": "float8_e4m3fn", "heads": 1},
    ],
)
def test_round_trip_dtypes_odd_heads_padding_kernel_split(params, pool_factory):
    params = dict(params)
    setup, layout, pool = build(params.pop("kind"), pool_factory, chunk_blocks=3, **params)
    engine = make_engine(layout, pool, torch.device("cpu"))
    assert isinstance(engine, CpuTorchEngine)
    try:
        rng = random.Random(7)
        for _ in range(3):
            round_trip(setup, layout, pool, engine, rng)
    finally:
        engine.shutdown()


def test_unaligned_chunk_lands_at_its_positions(pool_factory):
    """Blocks 5, 9, 2 as positions 2, 3 of slot 6 and 0 of slot 1 (a chunk starting mid-slot)."""
    setup, layout, pool = build("LBHNC", pool_factory, chunk_blocks=4)
    fill_random(layout, seed=11)
    pool.tensor.fill_(POISON)
    engine = CpuTorchEngine(layout, pool)
    batch = TransferBatch(0, np.array([5, 9, 2]), np.array([6, 6, 1]), np.array([2, 3, 0]))
    engine.submit(3, Direction.STORE, [batch])
    [res] = engine.wait([3])
    engine.shutdown()
    gbb = layout.groups[0].block_bytes
    assert res.ok and res.bytes == 3 * gbb
    slot6 = pool.tensor[6].numpy()
    assert (slot6[: 2 * gbb] == POISON).all()
    assert np.array_equal(slot6[2 * gbb : 3 * gbb], expected_block(setup, layout, 0, 5))
    assert np.array_equal(slot6[3 * gbb : 4 * gbb], expected_block(setup, layout, 0, 9))
    assert np.array_equal(pool.tensor[1, :gbb].numpy(), expected_block(setup, layout, 0, 2))
    assert (pool.tensor[1, gbb:].numpy() == POISON).all()
    others = [s for s in range(pool.slot_count) if s not in (1, 6)]
    assert (pool.tensor[others].numpy() == POISON).all()


def _batch(group=0, blocks=(0,), slots=(0,), pos=(0,)):
    return TransferBatch(group, np.array(blocks), np.array(slots), np.array(pos))


@pytest.mark.parametrize(
    ("direction", "batch", "message"),
    [
        (Direction.STORE, _batch(blocks=(24,)), "gpu_blocks out of range"),
        (Direction.STORE, _batch(blocks=(-1,)), "gpu_blocks out of range"),
        (Direction.STORE, _batch(slots=(24,)), "slots out of range"),
        (Direction.STORE, _batch(pos=(4,)), "slot_block_index out of range"),
        (Direction.STORE, _batch(group=5), "no KV group 5"),
        (
            Direction.LOAD,
            _batch(blocks=(1, 1), slots=(0, 1), pos=(0, 0)),
            "GPU block of group 0 twice",
        ),
        (Direction.STORE, _batch(blocks=(1, 2), slots=(3, 3), pos=(1, 1)), "slot position twice"),
    ],
)
def test_bad_batches_are_refused_and_nothing_moves(direction, batch, message, pool_factory):
    setup, layout, pool = build("LBHNC", pool_factory)
    fill_random(layout, seed=1)
    pool.tensor.fill_(POISON)
    before = [s.clone() for s in layout.storages]
    engine = CpuTorchEngine(layout, pool)
    try:
        with pytest.raises(ValueError, match=message):
            engine.submit(1, direction, [batch])
        assert engine.wait([1]) == [] and engine.poll() == []
        assert (pool.tensor.numpy() == POISON).all()
        assert all(torch.equal(a, b) for a, b in zip(before, layout.storages, strict=True))
    finally:
        engine.shutdown()


def test_batch_arrays_are_checked():
    with pytest.raises(ValueError, match="differ in length"):
        TransferBatch(0, np.array([1, 2]), np.array([1]), np.array([0]))
    with pytest.raises(ValueError, match="1-D"):
        TransferBatch(0, np.zeros((2, 2)), np.zeros(2), np.zeros(2))
    b = TransferBatch(0, [3, 4], [1, 1], [0, 1])
    assert b.gpu_blocks.dtype == np.int64 and len(b) == 2


def test_poll_reports_each_job_once_and_job_ids_are_not_reused_in_flight(pool_factory):
    setup, layout, pool = build("BLHNC", pool_factory)
    engine = CpuTorchEngine(layout, pool)
    try:
        for j in range(5):
            engine.submit(j, Direction.STORE, [_batch(blocks=(j,), slots=(j,))])
        done = engine.wait([0, 1])
        assert [r.job_id for r in done] == [0, 1]
        assert engine.wait([0, 1]) == []  # already reported
        engine.wait([4])  # jobs run in order: 2..4 are done too
        assert sorted(r.job_id for r in engine.poll()) == [2, 3]
        assert engine.poll() == []
        engine.submit(9, Direction.STORE, [_batch()])
        with pytest.raises(ValueError, match="in flight or unreported"):
            engine.submit(9, Direction.STORE, [_batch()])
        assert [r.ok for r in engine.wait([9])] == [True]
    finally:
        engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.submit(10, Direction.STORE, [_batch()])


def test_empty_job_completes(pool_factory):
    _, layout, pool = build("LBHNC", pool_factory)
    engine = CpuTorchEngine(layout, pool, inline=True)
    engine.submit(1, Direction.LOAD, [_batch(blocks=(), slots=(), pos=())])
    [res] = engine.poll()
    assert res.ok and res.job_id == 1 and res.bytes == 0


def _run_plan_store(layout, pool, pieces, capacity):
    """Execute a staged plan with numpy: gather regions into staging, then copy the runs."""
    flat = pool.tensor.view(-1).numpy()
    for p in pieces:
        g = layout.group(p.group)
        staging = np.full(capacity, 0xEE, dtype=np.uint8)
        for i, blk in enumerate(p.gpu_blocks):
            at = i * g.block_bytes
            for r in g.regions:
                src = layout.storages[r.storage].numpy()
                start = r.offset + int(blk) * r.block_stride
                staging[at : at + r.block_bytes] = src[start : start + r.block_bytes]
                at += r.block_bytes
        for pool_off, stg_off, n in p.runs:
            flat[pool_off : pool_off + n] = staging[stg_off : stg_off + n]


@pytest.mark.parametrize(
    ("capacity_blocks", "head", "tail"), [(1, 0, 0), (3, 0, 0), (64, 0, 0), (5, 1, 0), (5, 2, 3)]
)
def test_staged_plan_moves_what_the_reference_moves(capacity_blocks, head, tail, pool_factory):
    """The CUDA engine's plan (pieces + DMA runs), executed with numpy, writes the same pool
    bytes as the reference engine; runs never cross a registration piece and are maximal."""
    from kvoffload_connector.worker.transfer.plan import plan_pieces

    from tests.connector.kv_setup import random_batches

    setup, layout, pool = build("LBNHC", pool_factory, groups=2, chunk_blocks=4, num_blocks=40)
    fill_random(layout, seed=5)
    rng = random.Random(5)
    batches = random_batches(layout, pool.slot_count, rng, max_blocks=16)
    # a long unaligned chunk run over consecutive slots, to exercise run merging
    batches.append(
        TransferBatch(
            0,
            np.arange(30, 40),
            np.array([20] * 2 + [21] * 4 + [22] * 4),
            np.array([2, 3, 0, 1, 2, 3, 0, 1, 2, 3]),
        )
    )
    batches = [b for b in batches if b.group == 1] + [batches[-1]]
    reg = 2 * pool.slot_bytes  # registration pieces of two slots
    gbb = {g.group_id: g.block_bytes for g in layout.groups}
    cap = capacity_blocks * max(gbb.values())
    unit = max(gbb.values())
    pieces = plan_pieces(batches, gbb, pool.slot_bytes, cap, reg, head * unit, tail * unit)
    for p in pieces:
        assert len(p.gpu_blocks) * gbb[p.group] <= cap
    by_group: dict[int, list] = {}
    for p in pieces:
        by_group.setdefault(p.group, []).append(len(p.gpu_blocks))
    for sizes in by_group.values():
        assert not head or sizes[0] <= head
        assert not tail or sizes[-1] <= tail
        for pool_off, _, n in p.runs:
            assert pool_off // reg == (pool_off + n - 1) // reg
    pool.tensor.fill_(POISON)
    _run_plan_store(layout, pool, pieces, cap)
    got = pool.tensor.clone()
    pool.tensor.fill_(POISON)
    engine = CpuTorchEngine(layout, pool, inline=True)
    engine.submit(1, Direction.STORE, batches)
    assert engine.poll()[0].ok
    assert torch.equal(got, pool.tensor)
    if capacity_blocks == 64:  # slots 20..22 hold positions 2..3,0..3,0..1..: runs of 6 and 4
        last = pieces[-1]
        assert sorted(last.runs[:, 2].tolist()) == [4 * gbb[0], 6 * gbb[0]]


def _random_job(rng: np.random.Generator, groups: int, cb: int, slot_count: int, dup: bool):
    """Batches of random blocks, chunks starting mid-slot, in random slots or (every other
    group) in consecutive slots, so DMA runs cross slots; ``dup`` makes a LOAD read some slot
    positions twice (allowed: two GPU blocks from one pool block)."""
    batches = []
    for g in range(groups):
        n = int(rng.integers(0 if g else 1, 60))
        order = rng.permutation(slot_count) if g % 2 else np.arange(slot_count)
        pos, slots, at, used = [], [], int(rng.integers(cb)), int(rng.integers(8))
        while len(pos) < n:
            take = min(cb - at, n - len(pos))
            pos += range(at, at + take)
            slots += [int(order[used])] * take
            used += 1
            at = 0
        blocks = rng.permutation(200)[:n]
        b = TransferBatch(g, blocks, np.array(slots, dtype=np.int64), np.array(pos, dtype=np.int64))
        if dup and n > 2:
            s, p = b.slots.copy(), b.slot_block_index.copy()
            s[-1], p[-1] = s[0], p[0]
            b = TransferBatch(g, blocks, s, p)
        batches.append(b)
    return batches


@pytest.mark.parametrize("seed", range(6))
def test_job_plan_equals_the_eager_plan(seed):
    """JobPlan (lazy: piece 0 first, the rest in one pass) yields exactly plan_pieces' pieces,
    whatever piece is asked for first; ``ids``/``ids_at`` hold each piece's block ids."""
    from kvoffload_connector.worker.transfer.plan import JobPlan, plan_pieces

    rng = np.random.default_rng(seed)
    cb, slot_count = 4, 64
    gbb = {0: 96, 1: 64, 2: 32}
    slot_bytes = cb * 96 + 16
    cap = int(rng.choice([96, 3 * 96, 7 * 96, 100 * 96]))
    head, tail = [(0, 0), (96, 0), (0, 2 * 96), (2 * 96, 96)][seed % 4]
    reg = int(rng.choice([slot_bytes, 2 * slot_bytes, 1 << 40]))
    batches = _random_job(rng, 3, cb, slot_count, dup=seed % 2 == 1)
    want = plan_pieces(batches, gbb, slot_bytes, cap, reg, head, tail)
    for first in (0, len(want) - 1, len(want) // 2):
        plan = JobPlan(batches, gbb, slot_bytes, cap, reg, head, tail)
        assert len(plan) == len(want)
        plan.piece(first)
        got = list(plan)
        for a, b in zip(want, got, strict=True):
            assert a.group == b.group
            assert np.array_equal(a.gpu_blocks, b.gpu_blocks)
            assert np.array_equal(a.runs, b.runs)
        assert plan.ids_at[-1] == len(plan.ids) == sum(len(b) for b in batches)
        assert sum(len(p.runs) for p in got) < len(plan.ids)  # some runs span blocks
        for i, p in enumerate(got):
            assert np.array_equal(plan.ids[plan.ids_at[i] : plan.ids_at[i + 1]], p.gpu_blocks)


def test_job_plan_piece_zero_is_built_alone():
    """The engine enqueues piece 0 before the rest of the job is planned."""
    from kvoffload_connector.worker.transfer.plan import JobPlan

    n = 64
    batch = TransferBatch(
        0, np.arange(n)[::-1], np.repeat(np.arange(16), 4), np.tile(np.arange(4), 16)
    )
    plan = JobPlan([batch], {0: 32}, 128, 8 * 32, 1 << 40, head=2 * 32)
    p0 = plan.piece(0)
    assert list(plan._cache) == [0]
    assert p0.gpu_blocks.tolist() == [63, 62] and p0.runs.tolist() == [[0, 0, 64]]
    plan.piece(1)
    assert sorted(plan._cache) == list(range(len(plan)))
    assert [len(p.gpu_blocks) for p in plan] == [2] + [8] * 7 + [6]


def test_job_plan_empty_and_refusals():
    from kvoffload_connector.worker.transfer.plan import JobPlan

    plan = JobPlan([_batch(blocks=(), slots=(), pos=())], {0: 32}, 128, 256, 1 << 40)
    assert len(plan) == 0 and list(plan) == [] and plan.ids.dtype == np.int64
    assert plan.ids_at.tolist() == [0]
    with pytest.raises(ValueError, match="staging capacity"):
        JobPlan([_batch()], {0: 512}, 2048, 256, 1 << 40)


def test_validator_refuses_duplicates_across_batches_and_counts_bytes(pool_factory):
    """Duplicates split over two batches are caught (a STORE's slot positions across groups, a
    LOAD's blocks within one group); a valid job returns its GPU bytes."""
    from kvoffload_connector.worker.transfer.engine import BatchValidator

    _, layout, pool = build("LBHNC", pool_factory, groups=2)
    check = BatchValidator(layout)
    g0, g1 = (g.block_bytes for g in layout.groups)
    store = [_batch(0, (1, 2), (3, 3), (0, 1)), _batch(1, (1,), (3,), (1,))]
    with pytest.raises(ValueError, match="STORE job writes some slot position twice"):
        check(pool.slot_count, Direction.STORE, store)
    load = [_batch(0, (4,), (1,), (0,)), _batch(0, (4,), (2,), (0,))]
    with pytest.raises(ValueError, match="GPU block of group 0 twice"):
        check(pool.slot_count, Direction.LOAD, load)
    # the same block ids in two groups are two different blocks
    ok = [_batch(0, (4, 5), (1, 1), (0, 1)), _batch(1, (4,), (2,), (0,)), _batch(1, (), (), ())]
    assert check(pool.slot_count, Direction.LOAD, ok) == 2 * g0 + g1
    assert check(pool.slot_count, Direction.STORE, ok) == 2 * g0 + g1
    with pytest.raises(ValueError, match=r"slots out of range \[0, 24\): min -3, max 0"):
        check(pool.slot_count, Direction.STORE, [_batch(blocks=(1, 2), slots=(0, -3), pos=(0, 1))])
    with pytest.raises(ValueError, match="must be a Direction"):
        check(pool.slot_count, "h2d", ok)
    with pytest.raises(ValueError, match="expected TransferBatch"):
        check(pool.slot_count, Direction.LOAD, [object()])


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_layered_load_stages_follow_the_forward_and_cover_every_region_once(kind, pool_factory):
    """CudaEngine's stage plan, built on the CPU: one copy per layer in forward order, every
    region of every group moved by exactly one stage, and each layer waiting for the stage
    that moves its bytes (a later layer never waits for less than an earlier one needs)."""
    from kvoffload_connector.worker.transfer.cuda_tables import group_table, layer_stages

    setup, layout, _ = build(kind, pool_factory, groups=2, shared=True, heads=3, num_layers=11)
    cpu = torch.device("cpu")
    tables = {g.group_id: group_table(torch, cpu, layout, g) for g in layout.groups}
    stages, stage_of = layer_stages(layout, tables)
    assert set(stage_of) == set(setup.kv_caches)  # every layer knows what to wait for
    moved: dict[int, list[tuple[int, ...]]] = {}
    for st in stages:
        rows = [tuple(r) for r in st.regions.tolist()]
        assert st.n_regions == len(rows) > 0
        moved.setdefault(st.group, []).extend(rows)
    for g in layout.groups:
        table = [tuple(r) for r in tables[g.group_id].regions.tolist()]
        assert sorted(moved[g.group_id]) == sorted(table)  # each region once
    for name, gid, regions in layout.layers:
        st = stages[stage_of[name]]
        assert st.group == gid
        need = {tuple(tables[gid].regions[r].tolist()) for r in regions}
        upto = {
            tuple(r)
            for s in stages[: stage_of[name] + 1]
            if s.group == gid
            for r in s.regions.tolist()
        }
        assert need <= upto  # its bytes are moved by the stage it waits for or earlier
    if layout.tag.startswith("LB"):
        assert len(stages) == len({n for n, _, _ in layout.layers}) - 2  # shared layers: no stage


def test_cuda_engine_admission_refuses_fails_or_queues_a_job():
    """CudaEngine's one admission path for staged and layered jobs (checked here without a GPU:
    the enqueue step is a stand-in): a live id (in flight, unreported or queued for the step's
    layered start) raises, a refusal (the caller's, or the pool not yet registered) or an
    enqueue error becomes a failed JobResult, anything else is queued."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from kvoffload_connector.worker.transfer.cuda import CudaEngine

    pool_refusal: list[str | None] = [None]
    fake = SimpleNamespace(
        _closed=False,
        _jobs={},
        _done={},
        _step_loads=[],
        _device=None,
        _torch=SimpleNamespace(cuda=SimpleNamespace(device=lambda _d: nullcontext())),
        _refusal=lambda: pool_refusal[0],
    )
    fake._check_id = CudaEngine._check_id.__get__(fake)
    admit = CudaEngine._admit.__get__(fake)
    assert admit(1, lambda: "job-1", None) and fake._jobs == {1: "job-1"}
    with pytest.raises(ValueError, match="still in flight"):
        admit(1, lambda: "again", None)
    assert not admit(2, lambda: "never", "no layer map")
    assert fake._done[2].error == "no layer map" and not fake._done[2].ok
    pool_refusal[0] = "pool not registered with CUDA (yet)"
    assert not admit(5, lambda: "never", None)
    assert fake._done[5].error == "pool not registered with CUDA (yet)"
    pool_refusal[0] = None
    fake._step_loads.append((6, (), 0))
    with pytest.raises(ValueError, match="still in flight"):
        admit(6, lambda: "queued already", None)

    def broken():
        raise RuntimeError("cuMemcpyAsync h2d failed")

    assert not admit(3, broken, None)
    assert "cuMemcpyAsync h2d failed" in fake._done[3].error and 3 not in fake._jobs
    fake._closed = True
    with pytest.raises(RuntimeError, match="shut down"):
        admit(4, lambda: "late", None)


def test_cuda_engine_layered_start_fails_every_queued_job_on_an_enqueue_error():
    """The step's layered loads start as one sequence: queued jobs become in-flight jobs, or
    all of them failed JobResults if enqueuing raised (none left half-tracked); the queue is
    empty afterwards either way, and starting an empty queue does nothing."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from kvoffload_connector.worker.transfer.cuda import CudaEngine

    def enqueue_ok(queued):
        return [SimpleNamespace(job_id=j) for j, _, _ in queued]

    def enqueue_broken(queued):
        raise RuntimeError("cuLaunchKernel failed")

    fake = SimpleNamespace(
        _jobs={},
        _done={},
        _step_loads=[(7, (), 10), (8, (), 20)],
        _device=None,
        _torch=SimpleNamespace(cuda=SimpleNamespace(device=lambda _d: nullcontext())),
        _enqueue_layered=enqueue_ok,
    )
    start = CudaEngine._start_layered.__get__(fake)
    start()
    assert sorted(fake._jobs) == [7, 8] and fake._step_loads == [] and fake._done == {}
    start()  # nothing queued: nothing happens
    assert sorted(fake._jobs) == [7, 8]
    fake._jobs.clear()
    fake._step_loads = [(9, (), 1), (10, (), 2)]
    fake._enqueue_layered = enqueue_broken
    start()
    assert fake._jobs == {} and fake._step_loads == []
    assert [
        (j, r.ok, "cuLaunchKernel failed" in r.error) for j, r in sorted(fake._done.items())
    ] == [
        (9, False, True),
        (10, False, True),
    ]


def test_cuda_engine_jobs_sharing_one_copy_sequence_split_its_time_by_bytes():
    """A step's layered loads run as one sequence: each job reports its byte share of that
    sequence's time, so a rate computed over the jobs (bytes / summed seconds) stays true."""
    from types import SimpleNamespace

    from kvoffload_connector.worker.transfer.cuda import CudaEngine, _Job

    class Timer:
        def elapsed_time(self, end):
            return 80.0  # ms, the whole sequence

    pipe = SimpleNamespace(timers=[])
    jobs = [_Job(1, 300, Timer(), None, pipe, 0.75), _Job(2, 100, Timer(), None, pipe, 0.25)]
    fake = SimpleNamespace(_jobs={j.job_id: j for j in jobs}, _done={})
    finish = CudaEngine._finish.__get__(fake)
    for j in jobs:
        finish(j)
    assert [(r.job_id, r.bytes, r.seconds) for r in fake._done.values()] == [
        (1, 300, pytest.approx(0.06)),
        (2, 100, pytest.approx(0.02)),
    ]
    assert fake._jobs == {} and len(pipe.timers) == 2
