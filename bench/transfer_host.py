"""Host work of CudaEngine.submit() before the first DMA, on the CPU (no GPU needed).

The GPU transfer bench's 16 KiB-page cells miss their wall-time targets by host time in
``submit()`` (docs/BENCHMARKS.md, "GPU transfer engine"). This measures the numpy part of that
host work for the bench's own cells (1 GiB jobs, GPU blocks and slots at random, chunks of 16
blocks, 64 MiB pieces, 8 MiB edge piece): validation, planning, the time until the first piece
is planned (what gates the first DMA), and the per-piece host numpy work (run lists, block ids).
The CUDA driver calls themselves are not measured here (bench/transfer.py does, on the GPU).

    python bench/transfer_host.py [--reps 200] [--out FILE]

"before" is the eager planner ``plan_pieces`` (kept in plan.py as the reference); "after" is the
lazy ``JobPlan`` the engine uses. Validation is timed as it is now (``BatchValidator``); the
numbers before this change (``np.unique`` validation + eager plan, commit 9150996) are in
bench/results/transfer_host-before.json, joined into the last column when that file is there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time

import numpy as np
from kvoffload_connector.layout import canonicalize
from kvoffload_connector.transfer import Direction, TransferBatch
from kvoffload_connector.transfer.engine import validate_batches
from kvoffload_connector.transfer.testing import make_kv_caches

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
# as bench/transfer.py: page bytes -> (block_size, head_size, layers); 8 KV heads, bf16
PAGES = {16 * KiB: (16, 32, 32), 32 * KiB: (16, 64, 32), 64 * KiB: (16, 128, 32)}
PIECE, EDGE = 64 * MiB, 8 * MiB


def median_us(fn, reps: int) -> float:
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e6


def cell(kind: str, page: int, reps: int) -> dict:
    """One bench cell's job, planned the old way and the new way."""
    block_size, head_size, layers = PAGES[page]
    block_bytes = layers * page
    nb = GiB // block_bytes
    cb = max(1, min(16, 32 * MiB // block_bytes))
    # a tiny real cache gives the real regions; only num_blocks is scaled to the bench's
    setup = make_kv_caches(
        kind,
        num_layers=layers,
        num_blocks=4,
        heads=8,
        block_size=block_size,
        head_size=head_size,
        dtype="bfloat16",
    )
    layout = canonicalize(setup.kv_caches, setup.layer_groups, cb)
    layout = dataclasses.replace(
        layout, groups=tuple(dataclasses.replace(g, num_blocks=3 * nb) for g in layout.groups)
    )
    n_slots = 2 * (-(-nb // cb))
    slot_count = 3 * n_slots
    rng = np.random.default_rng(page)
    slots = rng.permutation(slot_count)[: n_slots // 2]
    idx = np.arange(nb)
    batch = TransferBatch(0, rng.permutation(3 * nb)[:nb], slots[idx // cb], idx % cb)
    gbb = {0: layout.groups[0].block_bytes}
    slot_bytes, reg = layout.slot_bytes, 1 << 30

    from kvoffload_connector.transfer.engine import BatchValidator
    from kvoffload_connector.transfer.plan import JobPlan, plan_pieces

    check = BatchValidator(layout)

    def old_plan():
        pieces = plan_pieces([batch], gbb, slot_bytes, PIECE, reg, head=EDGE)
        ids = np.concatenate([p.gpu_blocks for p in pieces])
        return pieces, ids, [p.runs.tolist() for p in pieces]

    def new_first():
        plan = JobPlan([batch], gbb, slot_bytes, PIECE, reg, head=EDGE)
        return plan.piece(0).runs.tolist()

    def new_plan():
        plan = JobPlan([batch], gbb, slot_bytes, PIECE, reg, head=EDGE)
        return plan.ids, [p.runs.tolist() for p in plan]

    old_pieces = old_plan()[0]
    new_pieces = list(JobPlan([batch], gbb, slot_bytes, PIECE, reg, head=EDGE))
    assert len(old_pieces) == len(new_pieces)
    for a, b in zip(old_pieces, new_pieces, strict=True):  # same plan, bit for bit
        assert np.array_equal(a.gpu_blocks, b.gpu_blocks) and np.array_equal(a.runs, b.runs)

    row = {
        "layout": "layer-major" if kind == "LBHNC" else "block-major",
        "page_bytes": page,
        "blocks": nb,
        "regions_per_block": len(layout.groups[0].regions),
        "pieces": len(new_pieces),
        "dma_runs": int(sum(len(p.runs) for p in new_pieces)),
    }
    for d in (Direction.STORE, Direction.LOAD):
        name = d.name.lower()
        row[f"validate_{name}_us"] = median_us(lambda d=d: check(slot_count, d, [batch]), reps)
        row[f"validate_batches_{name}_us"] = median_us(
            lambda d=d: validate_batches(layout, slot_count, d, [batch]), reps
        )
    row["old_plan_all_us"] = median_us(old_plan, reps)
    row["new_first_piece_us"] = median_us(new_first, reps)
    row["new_plan_all_us"] = median_us(new_plan, reps)
    v = max(row["validate_store_us"], row["validate_load_us"])
    row["old_first_dma_host_us"] = v + row["old_plan_all_us"]
    row["new_first_dma_host_us"] = v + row["new_first_piece_us"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default="bench/results/transfer_host.json")
    ap.add_argument("--before", default="bench/results/transfer_host-before.json")
    args = ap.parse_args()
    before = {}
    if os.path.exists(args.before):
        with open(args.before) as f:
            for r in json.load(f)["rows"]:
                before[(r["layout"], r["page_bytes"])] = r["old_first_dma_host_us"]
    rows = [cell(kind, page, args.reps) for page in PAGES for kind in ("LBHNC", "BLHNC")]
    cols = [
        ("layout", "layout"),
        ("page KiB", "page_bytes"),
        ("blocks", "blocks"),
        ("pieces", "pieces"),
        ("runs", "dma_runs"),
        ("validate S/L us", None),
        ("plan old us", "old_plan_all_us"),
        ("plan new: 1st piece / all us", None),
        ("to 1st piece: before -> now us", None),
    ]
    print(" | ".join(c for c, _ in cols))
    for r in rows:
        cells = [
            r["layout"],
            str(r["page_bytes"] // KiB),
            str(r["blocks"]),
            str(r["pieces"]),
            str(r["dma_runs"]),
            f"{r['validate_store_us']:.0f} / {r['validate_load_us']:.0f}",
            f"{r['old_plan_all_us']:.0f}",
            f"{r['new_first_piece_us']:.0f} / {r['new_plan_all_us']:.0f}",
            f"{before.get((r['layout'], r['page_bytes']), float('nan')):.0f}"
            f" -> {r['new_first_dma_host_us']:.0f}",
        ]
        print(" | ".join(cells))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "machine": platform.processor() or platform.machine(),
                "cpus": os.cpu_count(),
                "numpy": np.__version__,
                "reps": args.reps,
                "rows": rows,
            },
            f,
            indent=1,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
