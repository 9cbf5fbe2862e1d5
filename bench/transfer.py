"""GPU transfer engine vs the PCIe ceiling (one run on the GPU machine).

For per-block-per-layer pages of 16 KiB .. 2 MiB, in a layer-major (LBHNC: one region per layer)
and a block-major (BLHNC: one region per block) KV layout, times CudaEngine STORE, LOAD and both
at once, each job beside a plain cudaMemcpyAsync of the same bytes (the ceiling), through a
CUDA-registered shared-memory pool file, block ids and slots scattered at random. Then the load
of a 10,000-token Llama-3-8B-shaped prompt (32 layers, 8 KV heads, head 128, bf16, block 16:
625 blocks, 1.22 GiB).

    python -m bench transfer [--gib 1] [--reps 5] [--pages 16K,2M] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from kvoffload_connector.worker.layout import canonicalize
from kvoffload_connector.worker.pool_view import PoolView
from kvoffload_connector.worker.transfer import Direction, TransferBatch
from kvoffload_connector.worker.transfer.cuda import CudaEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test suite's KV builders
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import report  # noqa: E402

from tests.connector.kv_setup import make_kv_caches  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
LAYOUTS = {"LBHNC": "layer-major", "BLHNC": "block-major"}
# page bytes -> (block_size, head_size, layers); 8 KV heads, bf16, K and V packed: 8*N*4*D bytes
PAGES = {
    16 * KiB: (16, 32, 32),
    32 * KiB: (16, 64, 32),
    64 * KiB: (16, 128, 32),
    256 * KiB: (64, 128, 8),
    2 * MiB: (512, 128, 4),
}


def timed(fn, reps: int) -> float:
    """Median wall seconds of fn() (fn synchronizes), after one warm-up."""
    fn()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


class PoolFile:
    """One shared-memory file; a PoolView per geometry, registered with CUDA."""

    def __init__(self, nbytes: int) -> None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self.path = os.path.join(base, f"kvoffload-bench-{os.getpid()}.shm")
        with open(self.path, "wb") as f:
            f.truncate(nbytes)
        self.nbytes = nbytes
        fd = os.open(self.path, os.O_RDWR)  # pre-fault like the sidecar does
        os.posix_fallocate(fd, 0, nbytes)
        os.close(fd)

    def view(self, slot_bytes: int, slot_count: int) -> PoolView:
        v = PoolView.open(self.path, 0, slot_bytes, slot_count)
        t0 = time.perf_counter()
        v.start_device_registration(torch.device("cuda"))
        if not v.wait_ready(120):
            raise RuntimeError(f"registration failed: {v.error}")
        self.register_s_per_gb = (time.perf_counter() - t0) / (slot_bytes * slot_count / 1e9)
        return v

    def close(self) -> None:
        os.unlink(self.path)


def plain_copies(pool: PoolView, nbytes: int):
    """`plain(h2d, d2h)`: a cudaMemcpyAsync of ``nbytes`` from the pool memory to the GPU, the
    other way, or both at once on two streams."""
    gpu = torch.empty(2 * nbytes, dtype=torch.uint8, device="cuda")
    host = pool.tensor.view(-1)
    assert host.is_pinned(), "pool not seen as pinned"
    if host.numel() < 2 * nbytes:
        raise ValueError("the pool view must hold twice the job's bytes")
    up, down = torch.cuda.Stream(), torch.cuda.Stream()

    def plain(h2d: bool, d2h: bool) -> None:
        if h2d:
            with torch.cuda.stream(up):
                gpu[:nbytes].copy_(host[:nbytes], non_blocking=True)
        if d2h:
            with torch.cuda.stream(down):
                host[nbytes : 2 * nbytes].copy_(gpu[nbytes:], non_blocking=True)
        up.synchronize()
        down.synchronize()

    return plain


def ceiling(pool: PoolView, nbytes: int, reps: int) -> dict:
    """One big cudaMemcpyAsync each way, and both at once on two streams."""
    plain = plain_copies(pool, nbytes)
    return {
        "h2d_gbps": nbytes / timed(lambda: plain(True, False), reps) / 1e9,
        "d2h_gbps": nbytes / timed(lambda: plain(False, True), reps) / 1e9,
        "both_gbps": 2 * nbytes / timed(lambda: plain(True, True), reps) / 1e9,
    }


def paired_with_ceiling(pool: PoolView, nbytes: int, reps: int, store, load, both) -> dict:
    """Each engine job timed right beside the same bytes moved by plain cudaMemcpyAsync between
    the same pool memory and the GPU (order alternating): one ``nbytes`` copy for a store or a
    load, one each way at once for ``both`` (which moves 2 x ``nbytes``). The ratio is what a
    noisy, shared machine cannot move (a slow spell slows both sides of a pair). -> GB/s
    medians and the median of the per-pair ratios (``*_of_ceiling``)."""
    plain = plain_copies(pool, nbytes)

    def seconds(fn) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    out = {}
    cells = (
        ("store", store, False, True, 1),
        ("load", load, True, False, 1),
        ("both", both, True, True, 2),
    )
    for name, job, h2d, d2h, copies in cells:
        job(), plain(h2d, d2h)  # warm-up
        eng, ceil = [], []
        for i in range(reps):
            if i % 2:
                ceil.append(seconds(lambda h2d=h2d, d2h=d2h: plain(h2d, d2h)))
                eng.append(seconds(job))
            else:
                eng.append(seconds(job))
                ceil.append(seconds(lambda h2d=h2d, d2h=d2h: plain(h2d, d2h)))
        moved = copies * nbytes
        out[f"{name}_gbps"] = moved / statistics.median(eng) / 1e9
        out[f"{name}_paired_ceiling_gbps"] = moved / statistics.median(ceil) / 1e9
        out[f"{name}_of_ceiling"] = statistics.median(c / e for c, e in zip(ceil, eng, strict=True))
    return out


def scattered_batches(layout, nb: int, slots: np.ndarray, rng) -> TransferBatch:
    """``nb`` random GPU blocks laid chunk by chunk into ``slots``."""
    cb = layout.chunk_blocks
    blocks = rng.permutation(layout.groups[0].num_blocks)[:nb]
    idx = np.arange(nb)
    return TransferBatch(0, blocks, slots[idx // cb], idx % cb)


def kv_layout(kind: str, layers: int, blocks: int, block_size: int, head_size: int, cb: int):
    """KV caches as vLLM hands them over (8 KV heads, bf16) and their canonical layout."""
    setup = make_kv_caches(
        kind, num_layers=layers, num_blocks=blocks, heads=8, block_size=block_size,
        head_size=head_size, dtype="bfloat16", device="cuda",
    )  # fmt: skip
    return setup, canonicalize(setup.kv_caches, setup.layer_groups, cb)


def engine_cells(pool_file, kind: str, page: int, total: int, reps: int) -> dict:
    """Stores, loads and both at once of ``total`` bytes of ``page``-byte pages, each beside
    the plain copy of the same bytes."""
    block_size, head_size, layers = PAGES[page]
    nb = max(1, total // (layers * page))
    cb = max(1, min(16, 32 * MiB // (layers * page)))  # chunks of up to 32 MiB
    setup, layout = kv_layout(kind, layers, 3 * nb, block_size, head_size, cb)
    n_slots = 2 * (-(-nb // cb))
    pool = pool_file.view(
        layout.slot_bytes, min(pool_file.nbytes // layout.slot_bytes, 3 * n_slots)
    )
    rng = np.random.default_rng(page)
    slot_perm = rng.permutation(pool.slot_count)
    a = scattered_batches(layout, nb, slot_perm[: n_slots // 2], rng)
    b = scattered_batches(layout, nb, slot_perm[n_slots // 2 : n_slots], rng)
    used = set(a.gpu_blocks.tolist())
    free = np.array([x for x in range(layout.groups[0].num_blocks) if x not in used])
    b = TransferBatch(0, rng.permutation(free)[:nb], b.slots, b.slot_block_index)
    engine = CudaEngine(layout, pool, torch.device("cuda"))
    jid = iter(range(1 << 30))
    nbytes = nb * layout.groups[0].block_bytes
    submit_s: list[float] = []

    def one(direction, batch):
        j = next(jid)
        t0 = time.perf_counter()
        engine.submit(j, direction, [batch])
        submit_s.append(time.perf_counter() - t0)
        [r] = engine.wait([j])
        assert r.ok, r.error

    def both():
        j1, j2 = next(jid), next(jid)
        engine.submit(j1, Direction.STORE, [a])
        engine.submit(j2, Direction.LOAD, [b])
        rs = engine.wait([j1, j2])
        assert all(r.ok for r in rs), rs

    one(Direction.STORE, b)  # b's slots hold data for the loads
    paired = paired_with_ceiling(
        pool, nbytes, reps, lambda: one(Direction.STORE, a), lambda: one(Direction.LOAD, b), both
    )
    row = {"layout": LAYOUTS[kind], "page_bytes": page, "bytes": nbytes, **paired}
    row["submit_ms"] = statistics.median(submit_s) * 1e3
    engine.shutdown()
    pool.close()
    del setup, layout
    torch.cuda.empty_cache()
    return row


def llama_10k(pool_file, kind: str, reps: int) -> dict:
    """Load 625 blocks (10,000 tokens) of a Llama-3-8B-shaped KV cache into scattered blocks."""
    nb = 625
    setup, layout = kv_layout(kind, 32, 8192, 16, 128, 16)
    pool = pool_file.view(layout.slot_bytes, min(pool_file.nbytes // layout.slot_bytes, 400))
    rng = np.random.default_rng(10_000)
    batch = scattered_batches(layout, nb, rng.permutation(pool.slot_count)[: -(-nb // 16)], rng)
    engine = CudaEngine(layout, pool, torch.device("cuda"))
    engine.submit(0, Direction.STORE, [batch])
    assert engine.wait([0])[0].ok
    jid = iter(range(1, 1 << 30))

    def load():
        engine.submit(next(jid), Direction.LOAD, [batch])
        while not (rs := engine.poll()):
            pass
        assert rs[0].ok, rs[0].error

    wall = timed(load, reps)
    nbytes = nb * layout.groups[0].block_bytes
    engine.shutdown()
    pool.close()
    del setup, layout
    torch.cuda.empty_cache()
    return {
        "layout": LAYOUTS[kind],
        "bytes": nbytes,
        "wall_ms": wall * 1e3,
        "gbps": nbytes / wall / 1e9,
    }


def cell_row(r: dict) -> dict:
    row = {"page": f"{r['page_bytes'] // KiB}K", "layout": r["layout"]}
    if "error" in r:
        return row | {"error": r["error"][:80]}
    for job in ("store", "load", "both"):
        row |= {job: r[f"{job}_gbps"], f"{job} %": round(100 * r[f"{job}_of_ceiling"])}
    return row | {"submit ms": r["submit_ms"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="bytes per timed transfer, GiB")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--pages", default="16K,32K,64K,256K,2M")
    ap.add_argument("--out", default="bench/out/transfer.json")
    args = ap.parse_args()
    total = int(args.gib * GiB)
    pages = [int(p[:-1]) * (MiB if p.endswith("M") else KiB) for p in args.pages.split(",")]
    pool_file = PoolFile(int(3.5 * total) + 64 * MiB)
    rows, loads = [], []
    try:
        cpool = pool_file.view(16 * MiB, (2 * total) // (16 * MiB))
        ceil = ceiling(cpool, total, args.reps)
        cpool.close()
        print(f"ceiling: {ceil}", flush=True)
        for page in pages:
            for kind in LAYOUTS:
                try:
                    rows.append(engine_cells(pool_file, kind, page, total, args.reps))
                except Exception as exc:  # keep the other cells
                    rows.append({"layout": LAYOUTS[kind], "page_bytes": page, "error": repr(exc)})
                print(rows[-1], flush=True)
        for kind in LAYOUTS:
            try:
                loads.append(llama_10k(pool_file, kind, max(args.reps, 7)))
            except Exception as exc:
                loads.append({"layout": LAYOUTS[kind], "error": repr(exc)})
            print(loads[-1], flush=True)
    finally:
        pool_file.close()
    table_rows = [cell_row(r) for r in rows]
    machine_ = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    extra = {"ceiling": ceil, "llama_10k_load": loads, "cells": rows, "bytes_per_transfer": total}
    title = "transfer (GB/s; %: of a plain copy of the same bytes beside it)"
    report(title, table_rows, args.out, extra=extra | {"device": machine_})
    for r in loads:
        print(f"10K-token Llama-3-8B load, {r['layout']}: {r.get('wall_ms', r.get('error'))} ms")


if __name__ == "__main__":
    main()
