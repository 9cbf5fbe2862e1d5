"""Does a KV load slow a busy forward, and does the forward slow the load? (GPU machine)

Issue 6's multi-turn steps showed kvoffload's layered loads adding their whole copy time to
busy prefill steps. This bench isolates that: a stand-in prefill (32 "layers" of two bf16
GEMMs, 4,096 tokens of a Llama-3-8B shape) on the compute stream, beside the load of a
10,000-token Llama-3-8B-shaped prefix (625 blocks, 1.22 GiB) from a registered pool, four ways:

- ``layered``: the engine's layered load (an SM copy kernel per layer, 32 CTAs); each layer of
  the stand-in waits for its layer's bytes, as attention does in vLLM;
- ``layered-dma``: the same per-layer order through ``cuMemcpyBatchAsync`` (the engine's
  ``BatchCopy``, one call per layer, one entry per block), the same per-layer waits;
- ``staged``: the engine's asynchronous load (DMA of whole slots into GPU staging, scatter
  kernel), nothing waits for it;
- ``dma``: plain ``cuMemcpyAsync`` of the same bytes in 8 MiB pieces, nothing waits.

For each: the forward's time alone and beside the load, and the load's time alone and beside
the forward (CUDA events; medians). A load that overlaps leaves the forward's time as it was.

    PYTHONPATH=connector python3 bench/overlap.py [--tokens 4096] [--reps 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys

import numpy as np
import torch
from kvoffload_connector.layout import canonicalize
from kvoffload_connector.transfer import Direction
from kvoffload_connector.transfer.batch_copy import BatchCopy, CopyRuns
from kvoffload_connector.transfer.cuda import CudaEngine
from kvoffload_connector.transfer.testing import make_kv_caches
from transfer import PoolFile, scattered_batches  # bench/ is on sys.path

LAYERS, BLOCKS, CHUNK = 32, 625, 4


def forward(tokens: int):
    """A stand-in prefill: per layer an up and a down projection of a Llama-3-8B shape."""
    x = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16) / 64
    w2 = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16) / 128
    y = torch.empty(tokens, 14336, device="cuda", dtype=torch.bfloat16)
    z = torch.empty(tokens, 4096, device="cuda", dtype=torch.bfloat16)

    def run(wait_layer) -> None:
        for layer in range(LAYERS):
            wait_layer(layer)
            torch.mm(x, w1, out=y)
            torch.mm(y, w2, out=z)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of the stand-in prefill")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layer-ctas", type=int, default=32, help="the layered kernel's CTAs")
    ap.add_argument("--kinds", default="waits-only,layered,staged,dma,layered-dma")
    ap.add_argument("--out", default="bench/results/overlap.json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("overlap.py needs a CUDA GPU")
    setup = make_kv_caches(
        "LBHNC", num_layers=LAYERS, num_blocks=8192, heads=8, block_size=16, head_size=128,
        dtype="bfloat16", device="cuda",
    )  # fmt: skip
    layout = canonicalize(setup.kv_caches, setup.layer_groups, CHUNK)
    pool_file = PoolFile(3 << 30)
    pool = pool_file.view(layout.slot_bytes, (3 << 30) // layout.slot_bytes)
    rng = np.random.default_rng(6)
    slots = rng.permutation(pool.slot_count)[: -(-BLOCKS // CHUNK)]
    batch = scattered_batches(layout, BLOCKS, slots, rng)
    engine = CudaEngine(layout, pool, torch.device("cuda"), layer_ctas=a.layer_ctas)
    engine.submit(0, Direction.STORE, [batch])
    assert engine.wait([0])[0].ok
    g = layout.groups[0]
    names = [n for n, _, _ in layout.layers]
    nbytes = BLOCKS * g.block_bytes
    compute = torch.cuda.current_stream()
    side = torch.cuda.Stream(priority=-1)
    jid = iter(range(1, 1 << 30))

    # per layer: destination, source and size of each block's piece (the batched-DMA case)
    offs = np.cumsum([0] + [r.block_bytes for r in g.regions])
    base = pool.base_ptr + batch.slots * layout.slot_bytes + batch.slot_block_index * g.block_bytes
    per_layer = []
    for _, _, regs in layout.layers:
        dst, src, size = [], [], []
        for r in regs:
            reg = g.regions[r]
            ptr = layout.storages[reg.storage].data_ptr() + reg.offset
            dst.append(ptr + batch.gpu_blocks * reg.block_stride)
            src.append(base + offs[r])
            size.append(np.full(BLOCKS, reg.block_bytes))
        per_layer.append(CopyRuns(*(np.ascontiguousarray(np.concatenate(v), np.uint64)
                                    for v in (dst, src, size))))  # fmt: skip
    # the engine's batch call, flagged to prefer overlap with compute (as measured in session 8)
    bdma = BatchCopy.load(torch.cuda.current_device(), prefer_overlap=True)
    bdma_note = "cuMemcpyBatchAsync" if bdma is not None else "unavailable"
    layer_ev = [torch.cuda.Event(enable_timing=True) for _ in range(LAYERS)]
    scratch = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def start_load(kind: str):
        """Enqueue the load; return (per-layer wait or None, a finish() that waits for it)."""
        if kind == "layered":
            engine.new_step()
            j = next(jid)
            engine.submit_layered(j, [batch])
            return (lambda i: engine.wait_layer(names[i])), lambda: engine.wait([j])
        if kind == "staged":
            j = next(jid)
            engine.submit(j, Direction.LOAD, [batch])
            return None, lambda: engine.wait([j])
        side.wait_stream(compute)
        if kind == "waits-only":  # the per-layer waits with nothing to wait for
            for ev in layer_ev:
                ev.record(side)
            return (lambda i: compute.wait_event(layer_ev[i])), side.synchronize
        if kind == "layered-dma":
            for i, runs in enumerate(per_layer):
                bdma(runs, False, side.cuda_stream)
                layer_ev[i].record(side)
            return (lambda i: compute.wait_event(layer_ev[i])), side.synchronize
        host = pool.tensor.view(-1)
        piece = 8 << 20
        with torch.cuda.stream(side):
            for at in range(0, nbytes, piece):
                n = min(piece, nbytes - at)
                scratch[at : at + n].copy_(host[at : at + n], non_blocking=True)
        layer_ev[-1].record(side)
        return None, side.synchronize

    def timed(fn) -> float:
        """ms between events on ``stream`` around fn (which enqueues), median over reps."""
        out = []
        for _ in range(a.reps + 1):
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(compute)
            fn()
            e1.record(compute)
            torch.cuda.synchronize()
            out.append(e0.elapsed_time(e1))
        return statistics.median(out[1:])

    exact = None
    if bdma is not None:  # poison the target blocks, load them by layered DMA, compare
        ids = torch.as_tensor(batch.gpu_blocks, device="cuda")
        views = [
            layout.storages[r.storage][r.offset :].as_strided(
                (g.num_blocks, r.block_bytes), (r.block_stride, 1)
            )
            for r in g.regions
        ]
        before = [v.index_select(0, ids) for v in views]
        for v in views:
            v.index_fill_(0, ids, 0xA5)
        _, finish = start_load("layered-dma")
        finish()
        pairs = zip(views, before, strict=True)
        exact = all(torch.equal(v.index_select(0, ids), b) for v, b in pairs)
        del before

    run = forward(a.tokens)
    fwd_alone = timed(lambda: run(lambda i: None))
    rows = []
    kinds = [k for k in a.kinds.split(",") if k != "layered-dma" or bdma is not None]
    for kind in kinds:

        def load_only(kind=kind) -> None:
            _, finish = start_load(kind)
            finish()
            compute.wait_stream(side)

        def both(kind=kind) -> None:
            wait, finish = start_load(kind)
            run(wait or (lambda i: None))
            finish()

        def both_fwd_only(kind=kind) -> tuple[float, float | None]:
            """forward's own time beside the load (its last kernel, not the load's end), and
            when the load ended (side-stream loads)."""
            out, ends = [], []
            for _ in range(a.reps + 1):
                torch.cuda.synchronize()
                e0 = torch.cuda.Event(enable_timing=True)
                e1 = torch.cuda.Event(enable_timing=True)
                e0.record(compute)
                wait, finish = start_load(kind)
                run(wait or (lambda i: None))
                e1.record(compute)
                finish()
                torch.cuda.synchronize()
                out.append(e0.elapsed_time(e1))
                if kind in ("dma", "layered-dma", "waits-only"):
                    ends.append(e0.elapsed_time(layer_ev[-1]))
            return statistics.median(out[1:]), statistics.median(ends[1:]) if ends else None

        load_ms = timed(load_only)
        fwd_ms, load_end = both_fwd_only()
        all_ms = timed(both)
        rows.append({
            "load": kind,
            "load_alone_ms": round(load_ms, 2),
            "load_alone_gbps": round(nbytes / load_ms / 1e6, 1),
            "forward_alone_ms": round(fwd_alone, 2),
            "forward_beside_load_ms": round(fwd_ms, 2),
            "both_done_ms": round(all_ms, 2),
            "load_end_beside_ms": None if load_end is None else round(load_end, 2),
            "serial_ms": round(fwd_alone + load_ms, 2),
            "hidden": round((fwd_alone + load_ms - all_ms) / load_ms, 2),
        })  # fmt: skip
    result = {
        "machine": torch.cuda.get_device_name(),
        "host": platform.node(),
        "torch": torch.__version__,
        "tokens": a.tokens,
        "layer_ctas": a.layer_ctas,
        "load_bytes": nbytes,
        "batched_dma": bdma_note,
        "layered_dma_bit_exact": exact,
        "rows": rows,
    }
    print(f"{result['machine']}; forward: {LAYERS} layers x 2 GEMMs at {a.tokens} tokens; "
          f"load {nbytes / 2**30:.2f} GiB; batched DMA: {bdma_note}, exact {exact}")  # fmt: skip
    print(f"{'load':12s} {'load alone':>14s} {'fwd alone':>10s} {'fwd beside':>11s} "
          f"{'both done':>10s} {'serial':>8s} {'hidden':>7s} {'load end':>9s}")  # fmt: skip
    for r in rows:
        print(f"{r['load']:12s} {r['load_alone_ms']:6.1f} ms {r['load_alone_gbps']:4.0f}G "
              f"{r['forward_alone_ms']:10.1f} {r['forward_beside_load_ms']:11.1f} "
              f"{r['both_done_ms']:10.1f} {r['serial_ms']:8.1f} {r['hidden']:7.0%} "
              f"{r['load_end_beside_ms'] or 0:9.1f}")  # fmt: skip
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    engine.shutdown()
    pool.close()
    pool_file.close()


if __name__ == "__main__":
    main()
