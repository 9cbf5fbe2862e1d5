"""GPU transfer engine vs the PCIe ceiling (one run on the GPU machine).

For per-block-per-layer pages of 16 KiB .. 2 MiB, in a layer-major (LBHNC: one region per layer)
and a block-major (BLHNC: one region per block) KV layout, times CudaEngine STORE, LOAD and both
at once, beside one large cudaMemcpyAsync (the ceiling) and a per-page cudaMemcpyAsync loop in C
(swap_blocks-style), all through a CUDA-registered shared-memory pool file, block ids and slots
scattered at random. Then the load of a 10,000-token Llama-3-8B-shaped prompt (32 layers, 8 KV
heads, head 128, bf16, block 16: 625 blocks, 1.22 GiB) into scattered GPU blocks.

    python -m bench transfer [--gib 1] [--reps 5] [--out FILE]

Prints a table and writes JSON (default bench/out/transfer.json).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
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
from tests.connector.kv_setup import make_kv_caches  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
# page bytes -> (block_size, head_size, layers); 8 KV heads, bf16, K and V packed: 8*N*4*D bytes
PAGES = {
    16 * KiB: (16, 32, 32),
    32 * KiB: (16, 64, 32),
    64 * KiB: (16, 128, 32),
    256 * KiB: (64, 128, 8),
    2 * MiB: (512, 128, 4),
}

_LOOP_SRC = r"""
#include <cuda_runtime.h>
extern "C" int copy_loop(void** dst, void** src, const size_t* n, long count, cudaStream_t s) {
    for (long i = 0; i < count; ++i) {
        cudaError_t e = cudaMemcpyAsync(dst[i], src[i], n[i], cudaMemcpyDefault, s);
        if (e != cudaSuccess) return (int)e;
    }
    return 0;
}
"""


def build_loop_lib() -> ctypes.CDLL | None:
    """The per-chunk cudaMemcpyAsync loop in C (what swap_blocks does), built with nvcc."""
    d = tempfile.mkdtemp()
    src, lib = os.path.join(d, "loop.cu"), os.path.join(d, "libloop.so")
    with open(src, "w") as f:
        f.write(_LOOP_SRC)
    try:
        subprocess.run(
            ["nvcc", "-shared", "-Xcompiler", "-fPIC", "-o", lib, src],
            check=True,
            capture_output=True,
            timeout=120,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"(no nvcc loop helper: {exc})", file=sys.stderr)
        return None
    so = ctypes.CDLL(lib)
    so.copy_loop.argtypes = [ctypes.c_void_p] * 2 + [
        ctypes.c_void_p,
        ctypes.c_long,
        ctypes.c_void_p,
    ]
    return so


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


def ceiling(pool: PoolView, nbytes: int, reps: int) -> dict:
    """One big cudaMemcpyAsync each way, and both at once on two streams."""
    gpu = torch.empty(2 * nbytes, dtype=torch.uint8, device="cuda")
    host = pool.tensor.view(-1)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def h2d():
        with torch.cuda.stream(s1):
            gpu[:nbytes].copy_(host[:nbytes], non_blocking=True)
        s1.synchronize()

    def d2h():
        with torch.cuda.stream(s1):
            host[:nbytes].copy_(gpu[:nbytes], non_blocking=True)
        s1.synchronize()

    def both():
        with torch.cuda.stream(s1):
            gpu[:nbytes].copy_(host[:nbytes], non_blocking=True)
        with torch.cuda.stream(s2):
            host[nbytes : 2 * nbytes].copy_(gpu[nbytes:], non_blocking=True)
        s1.synchronize()
        s2.synchronize()

    streams = [torch.cuda.Stream() for _ in range(4)]
    piece = 16 * MiB

    def split(h2d_streams, d2h_streams):
        """16 MiB copies dealt round-robin over the given streams of each direction."""
        for i, at in enumerate(range(0, nbytes, piece)):
            if h2d_streams:
                with torch.cuda.stream(h2d_streams[i % len(h2d_streams)]):
                    gpu[at : at + piece].copy_(host[at : at + piece], non_blocking=True)
            if d2h_streams:
                with torch.cuda.stream(d2h_streams[i % len(d2h_streams)]):
                    host[nbytes + at : nbytes + at + piece].copy_(
                        gpu[nbytes + at : nbytes + at + piece], non_blocking=True
                    )
        torch.cuda.synchronize()

    assert host.is_pinned(), "pool not seen as pinned"
    s2a, s2b = streams[:2], streams[2:]
    out = {
        "h2d_gbps": nbytes / timed(h2d, reps) / 1e9,
        "d2h_gbps": nbytes / timed(d2h, reps) / 1e9,
        "both_gbps": 2 * nbytes / timed(both, reps) / 1e9,
        "h2d_2streams_gbps": nbytes / timed(lambda: split(s2a, []), reps) / 1e9,
        "d2h_2streams_gbps": nbytes / timed(lambda: split([], s2b), reps) / 1e9,
        "both_2streams_gbps": 2 * nbytes / timed(lambda: split(s2a, s2b), reps) / 1e9,
        "both_1stream_16MiB_gbps": 2 * nbytes / timed(lambda: split(s2a[:1], s2b[:1]), reps) / 1e9,
    }
    return out


def paired_with_ceiling(pool: PoolView, nbytes: int, reps: int, store, load, both) -> dict:
    """Each engine job timed right beside the same bytes moved by plain cudaMemcpyAsync between
    the same pool memory and the GPU (order alternating): one ``nbytes`` copy for a store or a
    load, one each way at once on two streams for ``both`` (which moves 2 x ``nbytes``). The
    ratio is what a noisy, shared machine cannot move (a slow spell slows both sides of a
    pair). -> GB/s medians and the median of the per-pair ratios (``*_of_ceiling``)."""
    gpu = torch.empty(2 * nbytes, dtype=torch.uint8, device="cuda")
    host = pool.tensor.view(-1)
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


def loop_copy(lib, pool: PoolView, storage: torch.Tensor, page: int, n: int, reps: int) -> dict:
    """swap_blocks-style: one cudaMemcpyAsync per page, both sides scattered at random."""
    rng = np.random.default_rng(0)
    gpu_pages = rng.permutation(storage.numel() // page)[:n].astype(np.uint64)
    pool_pages = rng.permutation(pool.slot_count * pool.slot_bytes // page)[:n].astype(np.uint64)
    g = storage.data_ptr() + gpu_pages * page
    h = pool.base_ptr + pool_pages * page
    sizes = np.full(n, page, dtype=np.uint64)
    s = torch.cuda.Stream()
    out = {}
    for name, dst, src in (("h2d", g, h), ("d2h", h, g)):

        def run(dst=dst, src=src):
            rc = lib.copy_loop(
                dst.ctypes.data, src.ctypes.data, sizes.ctypes.data, n, s.cuda_stream
            )
            assert rc == 0, rc
            s.synchronize()

        out[f"{name}_gbps"] = n * page / timed(run, reps) / 1e9
    return out


def scattered_batches(layout, nb: int, slots: np.ndarray, rng, first: int = 0):
    """``nb`` random GPU blocks (from ``first`` on) laid chunk by chunk into ``slots``."""
    cb = layout.chunk_blocks
    g = layout.groups[0]
    blocks = first + rng.permutation(g.num_blocks - first)[:nb]
    idx = np.arange(nb)
    return TransferBatch(0, blocks, slots[idx // cb], idx % cb)


def _cell_setup(pool_file, kind: str, page: int, total: int, pool_factor: int = 1):
    """KV caches, layout and a pool view for one page size: ``total`` bytes of blocks, chunks of
    up to 32 MiB, a pool of ``pool_factor`` x twice the slots one job needs.
    -> (setup, layout, pool, blocks, chunk, slots)"""
    block_size, head_size, layers = PAGES[page]
    nb = max(1, total // (layers * page))
    cb = max(1, min(16, 32 * MiB // (layers * page)))
    setup = make_kv_caches(
        kind,
        num_layers=layers,
        num_blocks=3 * nb,
        heads=8,
        block_size=block_size,
        head_size=head_size,
        dtype="bfloat16",
        device="cuda",
    )
    layout = canonicalize(setup.kv_caches, setup.layer_groups, cb)
    n_slots = 2 * (-(-nb // cb))
    pool = pool_file.view(
        layout.slot_bytes, min(pool_file.nbytes // layout.slot_bytes, pool_factor * n_slots)
    )
    return setup, layout, pool, nb, cb, n_slots


def engine_cells(
    pool_file, kind: str, page: int, total: int, reps: int, loop_lib, store_ctas: int = 8
) -> dict:
    setup, layout, pool, nb, cb, n_slots = _cell_setup(pool_file, kind, page, total, 3)
    rng = np.random.default_rng(page)
    slot_perm = rng.permutation(pool.slot_count)
    a = scattered_batches(layout, nb, slot_perm[: n_slots // 2], rng)
    b = scattered_batches(layout, nb, slot_perm[n_slots // 2 : n_slots], rng)
    used = set(a.gpu_blocks.tolist())
    free = np.array([x for x in range(layout.groups[0].num_blocks) if x not in used])
    b = TransferBatch(0, rng.permutation(free)[:nb], b.slots, b.slot_block_index)
    engine = CudaEngine(layout, pool, torch.device("cuda"), store_ctas=store_ctas)
    jid = iter(range(1 << 30))
    nbytes = nb * layout.groups[0].block_bytes
    dev: dict[Direction, list[float]] = {Direction.STORE: [], Direction.LOAD: []}
    submit_s: list[float] = []

    def one(direction, batch):
        j = next(jid)
        t0 = time.perf_counter()
        engine.submit(j, direction, [batch])
        submit_s.append(time.perf_counter() - t0)
        [r] = engine.wait([j])
        assert r.ok, r.error
        dev[direction].append(r.seconds)

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
    row = {
        "layout": "layer-major" if kind == "LBHNC" else "block-major",
        "page_bytes": page,
        "layers": PAGES[page][2],
        "regions_per_block": len(layout.groups[0].regions),
        "store_ctas": store_ctas,
        "chunk_blocks": cb,
        "slot_bytes": layout.slot_bytes,
        "bytes": nbytes,
        **paired,
    }
    for direction, batch in ((Direction.STORE, a), (Direction.LOAD, b)):  # one traced job each
        engine.trace = []
        one(direction, batch)
        t_done = time.perf_counter()
        t0 = engine.trace[0][1]
        trace = {label: round((t - t0) * 1e3, 3) for label, t in engine.trace}
        trace["done"] = round((t_done - t0) * 1e3, 3)
        row[f"{direction.name.lower()}_trace_ms"] = trace
    engine.trace = None
    row["store_device_gbps"] = nbytes / statistics.median(dev[Direction.STORE][1:]) / 1e9
    row["load_device_gbps"] = nbytes / statistics.median(dev[Direction.LOAD]) / 1e9
    row["submit_ms"] = statistics.median(submit_s) * 1e3
    if loop_lib is not None and kind == "LBHNC":
        n = min(nbytes // page, 65536)
        loop = loop_copy(loop_lib, pool, layout.storages[0], page, n, max(1, reps // 2))
        row["loop_h2d_gbps"], row["loop_d2h_gbps"] = loop["h2d_gbps"], loop["d2h_gbps"]
    engine.shutdown()
    pool.close()
    del setup, layout
    torch.cuda.empty_cache()
    return row


def kernel_rates(engine, layout, batch, pool) -> dict:
    """HBM-side rate of the gather (store, 8 CTAs) and scatter (load, 16 CTAs) kernels alone
    on one staging piece: the headroom they leave over PCIe."""
    from kvoffload_connector.worker.transfer.plan import plan_pieces

    gbb = layout.groups[0].block_bytes
    [piece, *_] = plan_pieces([batch], {0: gbb}, pool.slot_bytes, engine._capacity, 1 << 62)
    ids = torch.from_numpy(piece.gpu_blocks).cuda()
    buf = torch.empty(engine._capacity, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream()
    out = {}
    for name, to_staging, ctas in (("gather", True, 8), ("scatter", False, 16)):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        engine._copy_kernel(
            piece, ids.data_ptr(), buf.data_ptr(), stream.cuda_stream, to_staging, ctas
        )
        t0.record()
        for _ in range(20):
            engine._copy_kernel(
                piece, ids.data_ptr(), buf.data_ptr(), stream.cuda_stream, to_staging, ctas
            )
        t1.record()
        t1.synchronize()
        out[f"{name}_{ctas}cta_gbps"] = 20 * piece.nbytes / (t0.elapsed_time(t1) / 1e3) / 1e9
    return out


def llama_10k(pool_file, kind: str, reps: int, dma_streams: int = 2) -> dict:
    """Load 625 blocks (10,000 tokens) of a Llama-3-8B-shaped KV cache into scattered blocks."""
    nb, cb = 625, 16
    setup = make_kv_caches(
        kind,
        num_layers=32,
        num_blocks=8192,
        heads=8,
        block_size=16,
        head_size=128,
        dtype="bfloat16",
        device="cuda",
    )
    layout = canonicalize(setup.kv_caches, setup.layer_groups, cb)
    pool = pool_file.view(layout.slot_bytes, min(pool_file.nbytes // layout.slot_bytes, 400))
    rng = np.random.default_rng(10_000)
    slots = rng.permutation(pool.slot_count)[: -(-nb // cb)]
    batch = scattered_batches(layout, nb, slots, rng)
    engine = CudaEngine(layout, pool, torch.device("cuda"), dma_streams=dma_streams)
    engine.submit(0, Direction.STORE, [batch])
    assert engine.wait([0])[0].ok
    jid = iter(range(1, 1 << 30))
    device_s = []
    submit_s = []

    def load():
        j = next(jid)
        t0 = time.perf_counter()
        engine.submit(j, Direction.LOAD, [batch])
        submit_s.append(time.perf_counter() - t0)
        while not (rs := engine.poll()):
            pass
        assert rs[0].ok, rs[0].error
        device_s.append(rs[0].seconds)

    wall = timed(load, reps)
    nbytes = nb * layout.groups[0].block_bytes
    kernels = kernel_rates(engine, layout, batch, pool)
    engine.trace = []  # one traced load: where the host time of a submit goes
    load()
    t_done = time.perf_counter()
    t0 = engine.trace[0][1]
    trace = {label: round((t - t0) * 1e3, 3) for label, t in engine.trace}
    trace["poll saw it done"] = round((t_done - t0) * 1e3, 3)
    engine.trace = None
    engine.shutdown()
    pool.close()
    del setup, layout
    torch.cuda.empty_cache()
    return {
        "layout": "layer-major" if kind == "LBHNC" else "block-major",
        "dma_streams": dma_streams,
        "bytes": nbytes,
        "submit_ms": statistics.median(submit_s) * 1e3,
        "wall_ms": wall * 1e3,
        "device_ms": statistics.median(device_s) * 1e3,
        "gbps": nbytes / wall / 1e9,
        **kernels,
        "trace_ms": trace,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="bytes per timed transfer, GiB")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--pages", default="16K,32K,64K,256K,2M")
    ap.add_argument("--out", default="bench/out/transfer.json")
    ap.add_argument("--no-10k", action="store_true", help="skip the 10K-token load")
    ap.add_argument(
        "--store-ctas",
        default="8",
        type=lambda t: [int(x) for x in t.split(",")],
        help="store gather CTAs to measure, side by side (e.g. 1,2,8)",
    )
    args = ap.parse_args()
    total = int(args.gib * GiB)
    pages = [int(p[:-1]) * (MiB if p.endswith("M") else KiB) for p in args.pages.split(",")]
    pool_file = PoolFile(int(3.5 * total) + 64 * MiB)
    loop_lib = build_loop_lib()
    result: dict = {
        "machine": torch.cuda.get_device_name(),
        "host": platform.node(),
        "torch": torch.__version__,
        "bytes_per_transfer": total,
        "store_ctas": 8,
        "load_ctas": 16,
    }
    try:
        cpool = pool_file.view(16 * MiB, (2 * total) // (16 * MiB))
        result["register_s_per_gb"] = pool_file.register_s_per_gb
        result["ceiling"] = ceiling(cpool, total, args.reps)
        cpool.close()
        ceil = result["ceiling"]
        print(
            f"ceiling (one cudaMemcpyAsync, {total / GiB:.2f} GiB): H2D {ceil['h2d_gbps']:.1f}  "
            f"D2H {ceil['d2h_gbps']:.1f}  both {ceil['both_gbps']:.1f} GB/s",
            flush=True,
        )
        rows = []
        for page in pages:
            for kind in ("LBHNC", "BLHNC"):
                for ctas in args.store_ctas:
                    try:
                        rows.append(
                            engine_cells(pool_file, kind, page, total, args.reps, loop_lib, ctas)
                        )
                    except Exception as exc:  # keep the other cells
                        rows.append({"layout": kind, "page_bytes": page, "error": repr(exc)})
                    print(json.dumps(rows[-1]), flush=True)
        result["rows"] = rows
        result["llama_10k_load"] = []
        for kind, dmas in () if args.no_10k else (("LBHNC", 1), ("BLHNC", 1), ("LBHNC", 2)):
            try:
                result["llama_10k_load"].append(llama_10k(pool_file, kind, max(args.reps, 7), dmas))
            except Exception as exc:
                result["llama_10k_load"].append({"layout": kind, "error": repr(exc)})
            print(json.dumps(result["llama_10k_load"][-1]), flush=True)
    finally:
        pool_file.close()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print_table(result)


def print_table(r: dict) -> None:
    c = r["ceiling"]
    print(
        f"\n{r['machine']}; GB/s; ceiling H2D {c['h2d_gbps']:.1f} D2H {c['d2h_gbps']:.1f} "
        f"both {c['both_gbps']:.1f}; stores {r['store_ctas']} CTAs, loads {r['load_ctas']}"
    )
    print(
        f"two streams a direction: H2D {c['h2d_2streams_gbps']:.1f} "
        f"D2H {c['d2h_2streams_gbps']:.1f} both {c['both_2streams_gbps']:.1f}; "
        "one stream each, 16 MiB copies: "
        f"{c['both_1stream_16MiB_gbps']:.1f}"
    )
    print(
        "wall GB/s (submit -> done); %: median of each job's ratio to plain cudaMemcpyAsync of "
        "the same bytes (one copy; for both: one each way at once), same pool memory, timed "
        "right beside it; pair: that plain both-ways copy's GB/s; devS/devL: device time of "
        "the job, subms: host time in submit"
    )
    print(
        f"{'page':>6} {'layout':>12} {'reg':>4} {'store':>6} {'%':>4} {'load':>6} {'%':>4} "
        f"{'both':>6} {'%':>4} {'pair':>6} {'devS':>6} {'devL':>6} {'subms':>6} {'loopH2D':>8} "
        f"{'loopD2H':>8}"
    )
    for row in r["rows"]:
        page = f"{row['page_bytes'] // KiB}K"
        if "error" in row:
            print(f"{page:>6} {row['layout']:>12}  ERROR {row['error'][:80]}")
            continue
        print(
            f"{page:>6} {row['layout']:>12} {row['regions_per_block']:>4}"
            f"{'' if row.get('store_ctas', 8) == 8 else '/' + str(row['store_ctas'])} "
            f"{row['store_gbps']:6.1f} {100 * row['store_of_ceiling']:4.0f} "
            f"{row['load_gbps']:6.1f} {100 * row['load_of_ceiling']:4.0f} "
            f"{row['both_gbps']:6.1f} {100 * row['both_of_ceiling']:4.0f} "
            f"{row['both_paired_ceiling_gbps']:6.1f} {row['store_device_gbps']:6.1f} "
            f"{row['load_device_gbps']:6.1f} "
            f"{row['submit_ms']:6.2f} {row.get('loop_h2d_gbps', float('nan')):8.1f} "
            f"{row.get('loop_d2h_gbps', float('nan')):8.1f}"
        )
        if "store_trace_ms" in row:
            print(f"{'':>20} store trace {row['store_trace_ms']}")
            print(f"{'':>20} load trace {row['load_trace_ms']}")
    for row in r["llama_10k_load"]:
        if "error" in row:
            print(f"10K-token load {row['layout']}: ERROR {row['error'][:100]}")
        else:
            print(
                f"10K-token Llama-3-8B load ({row['bytes'] / GiB:.2f} GiB, {row['layout']}, "
                f"{row.get('dma_streams', '?')} DMA stream(s)): submit "
                f"{row.get('submit_ms', float('nan')):.2f} ms, {row['wall_ms']:.1f} ms wall, "
                f"{row['device_ms']:.1f} ms device, "
                f"{row['gbps']:.1f} GB/s (target <= 26 ms); kernels alone: gather "
                f"{row.get('gather_8cta_gbps', 0):.0f} GB/s (8 CTAs), scatter "
                f"{row.get('scatter_16cta_gbps', 0):.0f} GB/s (16 CTAs)"
            )
            print(f"   host trace of one load (ms from submit): {row.get('trace_ms')}")


if __name__ == "__main__":
    main()
