"""What a hybrid model's lookup costs by the number of sliding-window presence queries.

A sliding-window group is asked chunk by chunk (one single-key query each). Asking every chunk
of a 32K-token prompt for 5 sliding groups is 2,500 queries; asking only the window before the
longest possible hit is ~85. This times both shapes of Lookup (plus the full group's one prefix
query) through the connector's `PoolClient` against a real sidecar, and writes JSON.

    python bench/hybrid_lookup.py [--calls 300] [--out bench/results/hybrid_lookup.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # sidecar_rpc, beside this script

import sidecar_rpc  # noqa: E402
from kvoffload_connector.sidecar_proc import SidecarProcess  # noqa: E402

PREFIX_KEYS = 500  # a 32K-token prompt in 64-token chunks
SHAPES = {"every chunk (before)": 2500, "window only (now)": 85}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/hybrid_lookup.json")
    args = parser.parse_args()
    sidecar = SidecarProcess(pool_size="256Mi")
    sidecar.start()
    rows = []
    try:
        client, keys = sidecar_rpc.connector_client(f"unix:{sidecar.socket}")
        prefix = keys[:PREFIX_KEYS]
        for name, presence in SHAPES.items():
            queries = [[keys[i % len(keys)]] for i in range(presence)] + [prefix]
            samples = []
            for i in range(args.calls + 20):
                start = time.perf_counter()
                client.lookup(queries)
                if i >= 20:
                    samples.append(time.perf_counter() - start)
            samples.sort()
            row = {
                "shape": name,
                "presence_queries": presence,
                "p50_us": round(samples[len(samples) // 2] * 1e6, 1),
                "p99_us": round(samples[int(len(samples) * 0.99) - 1] * 1e6, 1),
            }
            rows.append(row)
        client.close()
    finally:
        sidecar.close()
    print(f"{'lookup shape':<22} {'presence queries':>16} {'p50 µs':>9} {'p99 µs':>9}")
    for r in rows:
        print(
            f"{r['shape']:<22} {r['presence_queries']:>16} {r['p50_us']:>9.1f} {r['p99_us']:>9.1f}"
        )
    result = {
        "bench": "hybrid_lookup",
        "host": platform.node(),
        "python": platform.python_version(),
        "calls": args.calls,
        "prefix_keys": PREFIX_KEYS,
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
