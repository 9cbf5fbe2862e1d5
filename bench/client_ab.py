"""The connector's `PoolClient` at two revisions, call for call against one real sidecar.

Loads `connector/kvoffload_connector/client.py` as it is at `--ref` (git) beside the working
tree's, registers both with one `kvoffload sidecar` subprocess and times `lookup` of 1, 64 and
1,024 committed keys, alternating the two clients call by call (the order flips every call),
so both see the same machine. Prints p50/p90/p99 per client and the difference; writes JSON.

    python bench/client_ab.py [--ref HEAD~1] [--calls 4000] [--out bench/results/client_ab.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import sidecar_rpc
from kvoffload_connector import client as current_client

ROOT = Path(__file__).resolve().parents[1]
CLIENT_PATH = "connector/kvoffload_connector/client.py"


def client_at(ref: str, workdir: Path) -> ModuleType:
    """`client.py` as of git `ref`, imported as its own module."""
    try:
        source = subprocess.check_output(
            ["git", "show", f"{ref}:{CLIENT_PATH}"], cwd=ROOT, stderr=subprocess.PIPE
        )
    except subprocess.CalledProcessError as e:
        raise SystemExit(
            f"--ref {ref}: no {CLIENT_PATH} there ({e.stderr.decode().strip()})"
        ) from None
    path = workdir / "client_at_ref.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("client_at_ref", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


def _quantiles(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {f"p{q}_us": round(s[min(len(s) - 1, int(len(s) * q / 100))], 1) for q in (50, 90, 99)}


def run(ref_module: ModuleType, target: str, calls: int, warmup: int) -> list[dict[str, Any]]:
    clients = {"ref": sidecar_rpc.connector_client(target, ref_module.PoolClient)}
    clients["current"] = sidecar_rpc.connector_client(target, current_client.PoolClient)
    keys = clients["current"][1]
    rows = []
    for n in sidecar_rpc.SIZES:
        hit = keys[:n]
        samples: dict[str, list[float]] = {name: [] for name in clients}
        for i in range(warmup + calls):
            for name in ("ref", "current") if i % 2 else ("current", "ref"):
                client = clients[name][0]
                start = time.perf_counter()
                answer = client.lookup([hit])
                elapsed = time.perf_counter() - start
                if answer != [n]:
                    raise SystemExit(f"{name}: lookup answered {answer}, expected [{n}]")
                if i >= warmup:
                    samples[name].append(elapsed * 1e6)
        row: dict[str, Any] = {"op": "lookup", "keys": n, "calls": calls}
        for name, values in samples.items():
            row[name] = _quantiles(values)
        row["current_minus_ref"] = {
            k: round(row["current"][k] - row["ref"][k], 1) for k in row["current"]
        }
        rows.append(row)
        print(f"  {n:>5} keys  ref {row['ref']}  current {row['current']}", file=sys.stderr)
    for client, _ in clients.values():
        client.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ref", default="HEAD~1", help="git revision of the other client.py")
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--pool-dir", type=Path, default=Path("/dev/shm"))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "client_ab.json")
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvo-ab-") as work:
        ref_module = client_at(ns.ref, Path(work))
        pool_dir = Path(tempfile.mkdtemp(prefix="kvo-ab-pool-", dir=ns.pool_dir))
        try:
            with sidecar_rpc.sidecar(pool_dir, "256Mi") as target:
                rows = run(ref_module, target, ns.calls, ns.warmup)
        finally:
            shutil.rmtree(pool_dir, ignore_errors=True)
    ref_rev = subprocess.check_output(["git", "rev-parse", "--short", ns.ref], cwd=ROOT).decode()
    print(f"ref = {ns.ref} ({ref_rev.strip()}), current = the working tree")
    print(f"{'keys':>5} {'client':<14} {'p50 µs':>8} {'p90 µs':>8} {'p99 µs':>8}")
    for row in rows:
        for name, label in (
            ("ref", "ref"),
            ("current", "current"),
            ("current_minus_ref", "current - ref"),
        ):
            q = row[name]
            print(
                f"{row['keys']:>5} {label:<14} {q['p50_us']:>8.1f} {q['p90_us']:>8.1f} "
                f"{q['p99_us']:>8.1f}"
            )
    report = {
        "bench": "client_ab",
        "ref": ns.ref,
        "ref_commit": ref_rev.strip(),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": sys.version},
        "results": rows,
    }
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
