"""Round trips to a real `kvoffload sidecar` over its Unix socket: p50/p99 per call.

Starts the sidecar as a subprocess, registers one namespace, commits 1,024 keys, then times
Lookup, ReserveStore (each undone by an untimed AbortStore) and ReserveLoad (each undone by an
untimed Release) with 1, 64 and 1,024 keys, as unary calls and inside one Session stream.
Prints a table and writes JSON (`--out`, default bench/results/sidecar_rpc.json).

    python bench/sidecar_rpc.py [--calls 2000] [--pool-dir /dev/shm] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvoffload.v1 import pool_pb2 as pb
from kvoffload.v1 import pool_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
KEY_SIZE = 32
SLOT_BYTES = 16 << 10
SIZES = (1, 64, 1024)


def _keys(first: int, n: int) -> bytes:
    return b"".join(i.to_bytes(KEY_SIZE, "big") for i in range(first, first + n))


@contextmanager
def sidecar(pool_dir: Path, pool_size: str) -> Iterator[str]:
    work = Path(tempfile.mkdtemp(prefix="kvo-bench-", dir="/tmp"))
    sock = work / "pool.sock"
    script = Path(sys.executable).parent / "kvoffload"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "kvoffload_cli.main"]
    log = open(work / "sidecar.log", "wb")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        [
            *cmd,
            "sidecar",
            "--pool-size",
            pool_size,
            "--pool-dir",
            str(pool_dir),
            "--socket",
            str(sock),
            "--log-level",
            "WARNING",
        ],
        stdout=log,
        stderr=log,
    )
    target = f"unix:{sock}"
    try:
        deadline = time.monotonic() + 60
        with grpc.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                        break
                except grpc.RpcError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(
                        f"sidecar did not start:\n{(work / 'sidecar.log').read_text()}"
                    )
                time.sleep(0.05)
        yield target
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(work, ignore_errors=True)


class SessionCaller:
    """One Session stream; `call(**oneof)` sends a request and waits for its answer."""

    def __init__(self, stub: pb_grpc.KVPoolStub, client_id: int) -> None:
        self._q: queue.SimpleQueue[pb.SessionRequest | None] = queue.SimpleQueue()
        self._responses = stub.Session(iter(self._q.get, None))
        self._seq = 0
        self.call(attach=pb.AttachRequest(client_id=client_id))

    def call(self, **oneof: Any) -> pb.SessionResponse:
        self._seq += 1
        self._q.put(pb.SessionRequest(seq=self._seq, **oneof))
        resp = next(self._responses)
        if resp.WhichOneof("result") == "error":
            raise RuntimeError(f"session error: {resp.error.message}")
        return resp

    def close(self) -> None:
        self._q.put(None)
        for _ in self._responses:
            pass


def _time(calls: int, warmup: int, op: Callable[[], Callable[[], None] | None]) -> list[float]:
    """Run `op` warmup+calls times; op returns an untimed undo. Seconds per timed call."""
    samples = []
    for i in range(warmup + calls):
        start = time.perf_counter()
        undo = op()
        elapsed = time.perf_counter() - start
        if undo is not None:
            undo()
        if i >= warmup:
            samples.append(elapsed)
    return samples


def _quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, max(0, int(q * len(sorted_values) + 0.5) - 1))]


def _ops(
    stub: pb_grpc.KVPoolStub, session: SessionCaller, ns: str, cid: int, committed: bytes, n: int
) -> list[tuple[str, str, Callable[[], Callable[[], None] | None]]]:
    """(op, mode, call) for n keys: each call does one timed RPC and returns its untimed undo."""
    hit = committed[: n * KEY_SIZE]
    new = _keys(1 << 40, n)  # never committed: every key NEW
    lookup_req = pb.LookupRequest(namespace_id=ns, queries=[pb.KeyList(keys=hit)])
    store_req = pb.ReserveStoreRequest(namespace_id=ns, client_id=cid, keys=new)
    load_req = pb.ReserveLoadRequest(namespace_id=ns, client_id=cid, keys=hit)

    def abort(store_id: int) -> Callable[[], None]:
        return lambda: stub.AbortStore(pb.AbortStoreRequest(namespace_id=ns, store_id=store_id))

    def release(pin_id: int) -> Callable[[], None]:
        return lambda: stub.Release(
            pb.ReleaseRequest(namespace_id=ns, client_id=cid, pin_ids=[pin_id])
        )

    def check(cond: bool, what: str) -> None:
        if not cond:
            raise SystemExit(f"unexpected answer: {what}")

    def u_lookup() -> None:
        check(stub.Lookup(lookup_req).hit_counts[0] == n, "lookup miss")

    def u_store() -> Callable[[], None]:
        r = stub.ReserveStore(store_req)
        check(len(r.slots) == n, "store not NEW")
        return abort(r.store_id)

    def u_load() -> Callable[[], None]:
        r = stub.ReserveLoad(load_req)
        check(len(r.slots) == n, "load miss")
        return release(r.pin_id)

    def s_lookup() -> None:
        check(session.call(lookup=lookup_req).lookup.hit_counts[0] == n, "lookup miss")

    def s_store() -> Callable[[], None]:
        r = session.call(reserve_store=store_req).reserve_store
        check(len(r.slots) == n, "store not NEW")
        sid = r.store_id
        return lambda: session.call(abort_store=pb.AbortStoreRequest(namespace_id=ns, store_id=sid))

    def s_load() -> Callable[[], None]:
        r = session.call(reserve_load=load_req).reserve_load
        check(len(r.slots) == n, "load miss")
        pid = r.pin_id
        return lambda: session.call(release=pb.ReleaseRequest(namespace_id=ns, pin_ids=[pid]))

    return [
        ("Lookup", "unary", u_lookup),
        ("Lookup", "session", s_lookup),
        ("ReserveStore", "unary", u_store),
        ("ReserveStore", "session", s_store),
        ("ReserveLoad", "unary", u_load),
        ("ReserveLoad", "session", s_load),
    ]


def run(target: str, calls: int, warmup: int) -> list[dict[str, Any]]:
    channel = grpc.insecure_channel(target)
    stub = pb_grpc.KVPoolStub(channel)
    spec = pb.NamespaceSpec(
        model="bench",
        dtype="bfloat16",
        kv_layout="LBHNC/packed-kv",
        block_size=16,
        chunk_blocks=1,
        tp_size=1,
        hash_algo="sha256",
        key_size=KEY_SIZE,
    )
    reg = stub.Register(
        pb.RegisterRequest(
            spec=spec, num_ranks=1, slot_bytes_per_rank=SLOT_BYTES, client_name="bench"
        ),
        timeout=10,
    )
    ns, cid = reg.namespace_id, reg.client_id
    committed = _keys(0, max(SIZES))
    res = stub.ReserveStore(
        pb.ReserveStoreRequest(namespace_id=ns, client_id=cid, keys=committed), timeout=10
    )
    stub.CommitStore(
        pb.CommitStoreRequest(namespace_id=ns, store_id=res.store_id, rank=0), timeout=10
    )
    session = SessionCaller(stub, cid)
    results = []
    for n in SIZES:
        for op, mode, fn in _ops(stub, session, ns, cid, committed, n):
            samples = sorted(_time(calls, warmup, fn))
            results.append(
                {
                    "op": op,
                    "mode": mode,
                    "keys": n,
                    "calls": len(samples),
                    "p50_us": round(_quantile(samples, 0.5) * 1e6, 1),
                    "p99_us": round(_quantile(samples, 0.99) * 1e6, 1),
                    "mean_us": round(sum(samples) / len(samples) * 1e6, 1),
                }
            )
            r = results[-1]
            print(
                f"  {op:<12} {mode:<7} {n:>5} keys  "
                f"p50 {r['p50_us']:>8.1f} µs  p99 {r['p99_us']:>8.1f} µs",
                file=sys.stderr,
                flush=True,
            )
    session.close()
    channel.close()
    return results


def _table(results: list[dict[str, Any]]) -> str:
    lines = [
        f"{'op':<12} {'mode':<8} {'keys':>5} {'calls':>6} "
        f"{'p50 µs':>9} {'p99 µs':>9} {'mean µs':>9}"
    ]
    for r in results:
        lines.append(
            f"{r['op']:<12} {r['mode']:<8} {r['keys']:>5} {r['calls']:>6} {r['p50_us']:>9.1f} "
            f"{r['p99_us']:>9.1f} {r['mean_us']:>9.1f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--calls", type=int, default=2000, help="timed calls per row (default 2000)"
    )
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument(
        "--pool-dir", type=Path, default=Path("/dev/shm") if os.path.isdir("/dev/shm") else None
    )
    parser.add_argument("--pool-size", default="256Mi")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "sidecar_rpc.json")
    ns = parser.parse_args()
    pool_dir = ns.pool_dir or Path(tempfile.mkdtemp(prefix="kvo-bench-pool-"))
    pool_dir = Path(tempfile.mkdtemp(prefix="kvo-bench-pool-", dir=pool_dir))
    try:
        with sidecar(pool_dir, ns.pool_size) as target:
            results = run(target, ns.calls, ns.warmup)
    finally:
        shutil.rmtree(pool_dir, ignore_errors=True)
    print(_table(results))
    report = {
        "bench": "sidecar_rpc",
        "machine": {
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "grpcio": grpc.__version__,
        },
        "transport": "unix socket, grpc sync client, grpc.aio server",
        "key_size": KEY_SIZE,
        "results": results,
    }
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
