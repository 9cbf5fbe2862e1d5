"""Block operations a second of the sidecar's `Pool` (1M slots, one core, no RPC: that is
sidecar_rpc's), each row --seconds after a warm-up: stores into free slots (filling the pool),
longest-prefix lookups and reserve_load + release of recent keys, and stores into the full pool
(every key evicts). A block op is one key handled by a call. The pool file is sparse with
64-byte slots (1M slots cost no memory).

    python -m bench index_ops [--slots 1048576] [--batch 1,64] [--policy lru,arc] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvoffload_sidecar.keys import NamespaceSpec
from kvoffload_sidecar.pool import Pool, PoolSettings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import report  # noqa: E402

SLOT_BYTES = 64
KEY_SIZE = 32
ALIGN = 2 << 20
TARGET_BLOCK_OPS = 10_000


def packed(ids: range | list[int]) -> bytes:
    return b"".join(i.to_bytes(KEY_SIZE, "big") for i in ids)


def rate(fn: Callable[[], int], seconds: float) -> tuple[float, float]:
    """Run fn (returns blocks handled) repeatedly for `seconds`; (calls/s, blocks/s)."""
    deadline = time.perf_counter() + seconds / 5
    while time.perf_counter() < deadline:  # warm-up
        fn()
    calls = blocks = 0
    start = time.perf_counter()
    end = start + seconds
    now = start
    while now < end:
        blocks += fn()
        calls += 1
        now = time.perf_counter()
    return calls / (now - start), blocks / (now - start)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def bench_policy(policy: str, slots: int, batches: list[int], seconds: float) -> list[dict]:
    pool_size = -(-slots * SLOT_BYTES // ALIGN) * ALIGN
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(
        prefix="kvoffload-bench-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    ) as d:
        pool = Pool(
            PoolSettings(pool_size=pool_size, pool_dir=Path(d), eviction=policy, prefault=False),
            liveness=lambda start, length: length <= 256,  # this process is the engine's rank
        )
        pool.start()
        try:
            spec = NamespaceSpec("bench", "bfloat16", "LBHNC", 16, 1, 1, "sha256", KEY_SIZE)
            reg = pool.register(spec, 1, SLOT_BYTES, "bench")
            ns, cid = reg.namespace_id, reg.client_id
            capacity = reg.regions[0].slot_count
            next_key = 0

            def store(batch: int) -> int:
                nonlocal next_key
                keys = packed(range(next_key, next_key + batch))
                next_key += batch
                res = pool.reserve_store(ns, cid, keys)
                if res.store_id:
                    pool.commit_store(ns, res.store_id, 0)
                return len(res.slots)

            # 1. fill the pool with new keys (free slots, no eviction), timed as one pass
            rss0 = rss_bytes()
            start = time.perf_counter()
            filled = 0
            while filled < capacity:
                filled += store(min(64, capacity - filled))
            fill_s = time.perf_counter() - start
            index_bytes_per_key = (rss_bytes() - rss0) / capacity
            rows.append(
                _row(
                    policy,
                    "store (fill, no eviction)",
                    64,
                    capacity / fill_s / 64,
                    capacity / fill_s,
                )
            )
            for batch in batches:
                rng = random.Random(batch)

                # flush_deferred: the policy touches the servicer runs after each answer
                def lookup(batch: int = batch, rng: random.Random = rng) -> int:
                    first = rng.randrange(next_key - capacity // 4, next_key - batch)
                    hits = pool.lookup(ns, [packed(range(first, first + batch))])[0]
                    pool.flush_deferred()
                    return hits

                def load(batch: int = batch, rng: random.Random = rng) -> int:
                    first = rng.randrange(next_key - capacity // 4, next_key - batch)
                    pin = pool.reserve_load(ns, cid, packed(range(first, first + batch)))
                    pool.flush_deferred()
                    if pin.pin_id:
                        pool.release(ns, cid, [pin.pin_id])
                    return len(pin.slots)

                rows.append(_row(policy, "lookup (hit prefix)", batch, *rate(lookup, seconds)))
                rows.append(_row(policy, "reserve_load + release", batch, *rate(load, seconds)))
                evicting = rate(lambda b=batch: store(b), seconds)
                rows.append(_row(policy, "store with eviction", batch, *evicting))
            stats = pool.stats().namespaces[0]
            assert stats.slot_count == capacity and stats.committed_slots == capacity
            assert stats.evicted_blocks > 0
            for row in rows:
                row["index_bytes_per_key"] = round(index_bytes_per_key, 1)
                row["slots"] = capacity
        finally:
            pool.close()
    return rows


def _row(policy: str, op: str, batch: int, calls: float, blocks: float) -> dict:
    return {
        "policy": policy,
        "op": op,
        "batch": batch,
        "calls_per_s": round(calls, 1),
        "block_ops_per_s": round(blocks, 1),
        "meets_target": blocks > TARGET_BLOCK_OPS,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=1 << 20, help="slots in the namespace")
    parser.add_argument("--batch", default="1,64", help="keys per call, comma separated")
    parser.add_argument("--policy", default="lru,arc", help="eviction policies to run")
    parser.add_argument("--seconds", type=float, default=1.0, help="measuring time per row")
    parser.add_argument("--out", default="bench/out/index_ops.json", help="JSON output path")
    args = parser.parse_args(argv)
    if args.slots < 1024:
        parser.error("--slots must be at least 1024")
    try:
        batches = [int(b) for b in args.batch.split(",")]
    except ValueError:
        parser.error(f"--batch must be comma-separated integers, got {args.batch!r}")
    if any(b < 1 or b > args.slots // 4 for b in batches):
        parser.error("each --batch must be in 1..slots/4")
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    rows: list[dict] = []
    for policy in args.policy.split(","):
        rows += bench_policy(policy.strip(), args.slots, batches, args.seconds)
    note = (
        f"slots: {rows[0]['slots']:,}; index memory per committed key: "
        f"{rows[0]['index_bytes_per_key']:.0f} B ({rows[0]['policy']}); peak RSS "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB; "
        f"target > {TARGET_BLOCK_OPS:,} block ops/s"
    )
    columns = ("policy", "op", "batch", "calls_per_s", "block_ops_per_s")
    report("index_ops", rows, args.out, extra={"args": vars(args), "note": note}, columns=columns)
    print(note)
    return 0 if all(r["meets_target"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
