"""The floor under the sidecar's RPC latency: an empty gRPC echo over a Unix socket.

Runs a trivial bytes-echo service (no pool work) in a subprocess, with the same transport as
the sidecar (Unix socket, grpc.aio or the threaded server), and times unary calls and a
bidirectional stream with a 36-byte and a 36 KiB payload (1 and 1,024 packed keys). Run it
beside `bench/sidecar_rpc.py` on the same machine: the difference is what the sidecar adds.

    python bench/grpc_floor.py [--calls 2000] [--out bench/results/grpc_floor.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc

METHOD = "/floor.Echo/Unary"
STREAM = "/floor.Echo/Stream"


def _ident(b: bytes) -> bytes:
    return b


def _serve_sync(address: str, ready: mp.Event) -> None:  # type: ignore[valid-type]
    def unary(req: bytes, ctx: grpc.ServicerContext) -> bytes:
        return req

    def stream(it, ctx):  # noqa: ANN001
        yield from it

    handler = grpc.method_handlers_generic_handler(
        "floor.Echo",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary, _ident, _ident),
            "Stream": grpc.stream_stream_rpc_method_handler(stream, _ident, _ident),
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(address)
    server.start()
    ready.set()
    server.wait_for_termination()


def _serve_aio(address: str, ready: mp.Event) -> None:  # type: ignore[valid-type]
    async def main() -> None:
        async def unary(req: bytes, ctx) -> bytes:  # noqa: ANN001
            return req

        async def stream(it, ctx):  # noqa: ANN001
            async for req in it:
                yield req

        handler = grpc.method_handlers_generic_handler(
            "floor.Echo",
            {
                "Unary": grpc.unary_unary_rpc_method_handler(unary, _ident, _ident),
                "Stream": grpc.stream_stream_rpc_method_handler(stream, _ident, _ident),
            },
        )
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(address)
        await server.start()
        ready.set()
        await server.wait_for_termination()

    asyncio.run(main())


def _pcts(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "p50_us": 1e6 * statistics.median(s),
        "p99_us": 1e6 * s[min(len(s) - 1, int(0.99 * len(s)))],
        "mean_us": 1e6 * statistics.fmean(s),
    }


def measure(address: str, calls: int, payload: bytes) -> dict[str, dict[str, float]]:
    with grpc.insecure_channel(address) as ch:
        unary = ch.unary_unary(METHOD)
        for _ in range(200):
            unary(payload)
        t = []
        for _ in range(calls):
            t0 = time.perf_counter()
            unary(payload)
            t.append(time.perf_counter() - t0)
        out = {"unary": _pcts(t)}
        # one request in flight at a time on a kept-open stream, as the sidecar's Session
        import queue

        q: queue.Queue[bytes | None] = queue.Queue()

        def reqs():
            while (item := q.get()) is not None:
                yield item

        stream = ch.stream_stream(STREAM)(reqs())
        for _ in range(200):
            q.put(payload)
            next(stream)
        t = []
        for _ in range(calls):
            t0 = time.perf_counter()
            q.put(payload)
            next(stream)
            t.append(time.perf_counter() - t0)
        q.put(None)
        out["stream"] = _pcts(t)
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", default="bench/results/grpc_floor.json")
    ns = ap.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, target in (("aio", _serve_aio), ("sync", _serve_sync)):
            address = f"unix://{tmp}/{name}.sock"
            ready = ctx.Event()
            proc = ctx.Process(target=target, args=(address, ready), daemon=True)
            proc.start()
            try:
                if not ready.wait(20):
                    print(f"{name} server did not start", file=sys.stderr)
                    return 1
                for keys in (1, 1024):
                    res = measure(address, ns.calls, os.urandom(36 * keys))
                    for mode, r in res.items():
                        rows.append({"server": name, "mode": mode, "keys": keys, **r})
            finally:
                proc.kill()
                proc.join(5)
    print(f"{'server':6} {'mode':7} {'keys':>5} {'p50 µs':>9} {'p99 µs':>9} {'mean µs':>9}")
    for r in rows:
        print(
            f"{r['server']:6} {r['mode']:7} {r['keys']:>5} {r['p50_us']:>9.1f} "
            f"{r['p99_us']:>9.1f} {r['mean_us']:>9.1f}"
        )
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"calls": ns.calls, "cpus": os.cpu_count(), "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
