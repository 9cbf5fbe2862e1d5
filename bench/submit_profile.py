"""Where CudaEngine.submit()'s host time goes, on the GPU machine (cProfile of the submits only).

Both directions at once lose to a plain two-way copy mostly by host time: the second job's first
DMA waits for the first job's whole ``submit()`` (every piece's launches and driver calls, 1.2-2.3
ms for a 1 GiB job). This profiles those submits for one bench cell (1 GiB jobs, blocks and slots
at random, as bench/transfer.py) and prints the functions that take the host time.

    PYTHONPATH=connector:bench python3 bench/submit_profile.py [--page 32K] [--layout LBHNC]
        [--reps 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time

import numpy as np
import torch
from kvoffload_connector.transfer import Direction
from kvoffload_connector.transfer.cuda import CudaEngine
from transfer import GiB, KiB, MiB, PoolFile, _cell_setup, scattered_batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--page", default="32K", help="16K, 32K, 64K, 256K or 2M")
    ap.add_argument("--layout", default="LBHNC", choices=["LBHNC", "BLHNC"])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default="bench/results/submit_profile.json")
    args = ap.parse_args()
    page = int(args.page[:-1]) * (KiB if args.page.endswith("K") else MiB)
    pool_file = PoolFile(4 * GiB)
    try:
        _, layout, pool, nb, _, n_slots = _cell_setup(pool_file, args.layout, page, GiB, 3)
        rng = np.random.default_rng(1)
        batch = scattered_batches(layout, nb, rng.permutation(pool.slot_count)[:n_slots], rng)
        engine = CudaEngine(layout, pool, torch.device("cuda"))
        engine.submit(0, Direction.STORE, [batch])
        engine.wait([0])
        prof = cProfile.Profile()
        host: dict[str, list[float]] = {"store": [], "load": []}
        for i in range(1, 2 * args.reps + 1):
            direction = Direction.STORE if i % 2 else Direction.LOAD
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            prof.enable()
            engine.submit(i, direction, [batch])
            prof.disable()
            host["store" if i % 2 else "load"].append(time.perf_counter() - t0)
            [r] = engine.wait([i])
            assert r.ok, r.error
        engine.shutdown()
    finally:
        pool_file.close()
    stats = pstats.Stats(prof)
    n = 2 * args.reps
    rows = []
    for (file, line, func), (_, calls, tt, ct, _) in stats.stats.items():
        rows.append(
            {
                "function": f"{file.rsplit('/', 1)[-1]}:{line}({func})",
                "calls_per_submit": calls / n,
                "tottime_us_per_submit": 1e6 * tt / n,
                "cumtime_us_per_submit": 1e6 * ct / n,
            }
        )
    rows.sort(key=lambda r: -r["tottime_us_per_submit"])
    medians = {k: 1e3 * statistics.median(v) for k, v in host.items()}
    print(
        f"{args.layout} {args.page}, 1 GiB jobs: submit host ms (median, profiler on) "
        f"store {medians['store']:.2f}, load {medians['load']:.2f}"
    )
    print(f"{'function':60s} {'calls':>7s} {'tot us':>8s} {'cum us':>8s}   (per submit)")
    for r in rows[: args.top]:
        print(
            f"{r['function'][:60]:60s} {r['calls_per_submit']:7.1f} "
            f"{r['tottime_us_per_submit']:8.1f} {r['cumtime_us_per_submit']:8.1f}"
        )
    with open(args.out, "w") as f:
        json.dump(
            {"page": args.page, "layout": args.layout, "submit_ms": medians, "top": rows[:60]},
            f,
            indent=1,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
