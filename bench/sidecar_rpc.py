"""Round trips to a real `kvoffload sidecar` over its Unix socket: p50/p99 per call.

Starts the sidecar as a subprocess, registers one namespace, commits 1,024 keys, then times
Lookup, ReserveStore (each undone by an untimed AbortStore) and ReserveLoad (each undone by an
untimed Release) with 1, 64 and 1,024 keys: inside one Session stream driven by a bare loop
("session"), and through the connector's own `PoolClient` (its session object,
deadlines and key packing included, in a second namespace): on the gRPC Session stream
("client") and on the sidecar's framed session socket ("framed", what the connector uses when
the sidecar offers it). The target is judged on what the connector pays: "framed".

The floor of the same transport is measured in the same run: an empty bytes-echo server (a
grpc.aio subprocess on a Unix socket, no pool work, no protobuf) answers a request of the same
size as the sidecar's with a reply of the same size as the sidecar's, on one kept-open stream
driven exactly like the Session. Its calls alternate with the sidecar's, one for one, so
both see the same load; each row shows the floor and the sidecar's cost above it.
Prints a table and writes JSON (`--out`, default bench/out/sidecar_rpc.json).

    python -m bench sidecar_rpc [--calls 2000] [--sizes 1,64,1024] [--pool-dir /dev/shm]
                                [--out PATH] [--no-floor]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import platform
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvoffload.v1 import pool_pb2 as pb
from kvoffload.v1 import pool_pb2_grpc as pb_grpc
from kvoffload_connector.common.client import PoolClient
from kvoffload_connector.common.keys import build_spec, make_key, unpack_slots
from kvoffload_connector.worker.engine_lock import EngineLock, lock_offset

ROOT = Path(__file__).resolve().parents[1]
KEY_SIZE = 32
SLOT_BYTES = 16 << 10
SIZES = (1, 64, 1024)


ENGINE = 1  # the bench process is every rank of one engine: it holds the rank's lock
FENCE: dict[str, int] = {}  # sidecar_epoch and engine for commits and aborts, once registered
LOCKS: list[EngineLock] = []


def _hold(path: str, base: int, epoch: int) -> None:
    """Hold rank 0's engine lock (the sidecar grants stores only then) and remember the
    fence commits and aborts name."""
    if not LOCKS:
        LOCKS.append(EngineLock(path, lock_offset(base, ENGINE, 0)))
    FENCE.update(sidecar_epoch=epoch, engine=ENGINE)


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
            "--max-namespaces",
            "2",  # the bare session's namespace and the connector client's
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


# -- the transport's floor: an empty echo --------------------------------------------------------

ECHO_SERVICE = "floor.Echo"


def _ident(b: bytes) -> bytes:
    return b


def _echo_reply(req: bytes) -> bytes:
    """The request names the reply size in its first 4 bytes (the rest is padding)."""
    n = int.from_bytes(req[:4], "little")
    return req[4 : 4 + n] if n <= len(req) - 4 else bytes(n)


def _serve_framed_echo(path: str) -> None:
    """Thread: the framed socket's floor, served like the sidecar's (a blocking thread per
    connection reading a 4-byte little-endian length and the frame, answering one frame)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()

    def exactly(conn: socket.socket, n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return bytes(data)

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(ConnectionError, OSError):
            while True:
                size = int.from_bytes(exactly(conn, 4), "little")
                reply = _echo_reply(exactly(conn, size))
                conn.sendall(len(reply).to_bytes(4, "little") + reply)

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def _serve_echo(address: str, framed_path: str, ready: Any) -> None:
    """Subprocess: a grpc.aio server (like the sidecar's) with a stream echo, and the framed
    echo (like the sidecar's framed socket) in a thread."""
    threading.Thread(target=_serve_framed_echo, args=(framed_path,), daemon=True).start()

    async def serve() -> None:
        async def stream(_it: Any, ctx: Any) -> None:  # reads and writes like the Session
            while (req := await ctx.read()) is not grpc.aio.EOF:
                await ctx.write(_echo_reply(req))

        handler = grpc.method_handlers_generic_handler(
            ECHO_SERVICE,
            {
                "Stream": grpc.stream_stream_rpc_method_handler(stream, _ident, _ident),
            },
        )
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", 32 << 20),
                ("grpc.max_send_message_length", 32 << 20),
                ("grpc.so_reuseport", 0),
            ]
        )
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(address)
        await server.start()
        ready.set()
        await server.wait_for_termination()

    asyncio.run(serve())


@contextmanager
def echo_server() -> Iterator[tuple[str, str]]:
    """(gRPC echo target, framed echo socket path) served by one subprocess."""
    work = Path(tempfile.mkdtemp(prefix="kvo-floor-", dir="/tmp"))
    target = f"unix:{work / 'echo.sock'}"
    framed = str(work / "echo.session")
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_serve_echo, args=(target, framed, ready), daemon=True)
    proc.start()
    try:
        if not ready.wait(30):
            raise SystemExit("echo server did not start")
        deadline = time.monotonic() + 30
        while not os.path.exists(framed):
            if time.monotonic() > deadline:
                raise SystemExit("framed echo did not start")
            time.sleep(0.01)
        yield target, framed
    finally:
        proc.kill()
        proc.join(5)
        shutil.rmtree(work, ignore_errors=True)


class EchoCaller:
    """Stream echo calls of given request/reply sizes, driven like `SessionCaller` (a queue
    feeds the request iterator, one request in flight)."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._q: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        stream = channel.stream_stream(f"/{ECHO_SERVICE}/Stream", _ident, _ident)
        self._responses = stream(iter(self._q.get, None))

    def op(self, request_bytes: int, reply_bytes: int) -> Callable[[], None]:
        payload = reply_bytes.to_bytes(4, "little") + bytes(max(0, request_bytes - 4))
        q, responses = self._q, self._responses

        def stream_call() -> None:
            q.put(payload)
            next(responses)

        return stream_call

    def close(self) -> None:
        self._q.put(None)
        for _ in self._responses:
            pass


class FramedEchoCaller:
    """Echo calls on the framed echo socket, sent and read like the connector's FramedSession
    (one write per request, a blocking read of the answer)."""

    def __init__(self, path: str) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)

    def op(self, request_bytes: int, reply_bytes: int) -> Callable[[], None]:
        payload = reply_bytes.to_bytes(4, "little") + bytes(max(0, request_bytes - 4))
        message = len(payload).to_bytes(4, "little") + payload
        sock = self._sock

        def exactly(n: int) -> None:
            got = 0
            while got < n:
                chunk = sock.recv(n - got)
                if not chunk:
                    raise SystemExit("framed echo closed")
                got += len(chunk)

        def call() -> None:
            sock.sendall(message)
            header = sock.recv(4, socket.MSG_WAITALL)
            exactly(int.from_bytes(header, "little"))

        return call

    def close(self) -> None:
        self._sock.close()


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


def _time(
    calls: int,
    warmup: int,
    op: Callable[[], Callable[[], None] | None],
    floor: Callable[[], None] | None = None,
) -> tuple[list[float], list[float]]:
    """Run `op` warmup+calls times; op returns an untimed undo. After each, one timed `floor`
    call when given. Seconds per timed call: (op samples, floor samples)."""
    samples, floor_samples = [], []
    perf = time.perf_counter
    for i in range(warmup + calls):
        start = perf()
        undo = op()
        elapsed = perf() - start
        if undo is not None:
            undo()
        if floor is not None:
            start = perf()
            floor()
            floor_elapsed = perf() - start
            if i >= warmup:
                floor_samples.append(floor_elapsed)
        if i >= warmup:
            samples.append(elapsed)
    return samples, floor_samples


def _quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, max(0, int(q * len(sorted_values) + 0.5) - 1))]


Op = Callable[[], Callable[[], None] | None]


def _ops(
    session: SessionCaller, ns: str, cid: int, committed: bytes, n: int
) -> list[tuple[str, str, Op, tuple[int, int]]]:
    """(op, mode, call, (request bytes, reply bytes)) for n keys: each call does one timed RPC
    and returns its untimed undo; the sizes (from one probe call) size the floor's echo."""
    hit = committed[: n * KEY_SIZE]
    new = _keys(1 << 40, n)  # never committed: every key NEW
    lookup_req = pb.LookupRequest(namespace_id=ns, queries=[pb.KeyList(keys=hit)])
    store_req = pb.ReserveStoreRequest(namespace_id=ns, client_id=cid, keys=new)
    load_req = pb.ReserveLoadRequest(namespace_id=ns, client_id=cid, keys=hit)

    def check(cond: bool, what: str) -> None:
        if not cond:
            raise SystemExit(f"unexpected answer: {what}")

    def s_lookup() -> None:
        check(session.call(lookup=lookup_req).lookup.hit_counts[0] == n, "lookup miss")

    def s_store() -> Callable[[], None]:
        r = session.call(reserve_store=store_req).reserve_store
        check(len(unpack_slots(r.slots)) == n, "store not NEW")
        sid = r.store_id
        return lambda: session.call(
            abort_store=pb.AbortStoreRequest(namespace_id=ns, store_id=sid, **FENCE)
        )

    def s_load() -> Callable[[], None]:
        r = session.call(reserve_load=load_req).reserve_load
        check(len(unpack_slots(r.slots)) == n, "load miss")
        pid = r.pin_id
        return lambda: session.call(release=pb.ReleaseRequest(namespace_id=ns, pin_ids=[pid]))

    # One probe call per op gives the reply sizes (then undone); session messages carry a seq.
    s_sizes = {}
    for op, field, req in (
        ("Lookup", "lookup", lookup_req),
        ("ReserveStore", "reserve_store", store_req),
        ("ReserveLoad", "reserve_load", load_req),
    ):
        resp = session.call(**{field: req})
        sent = pb.SessionRequest(seq=1 << 20, **{field: req}).ByteSize()
        s_sizes[op] = (sent, resp.ByteSize())
        if op == "ReserveStore":
            sid = resp.reserve_store.store_id
            session.call(abort_store=pb.AbortStoreRequest(namespace_id=ns, store_id=sid, **FENCE))
        elif op == "ReserveLoad":
            pid = resp.reserve_load.pin_id
            session.call(release=pb.ReleaseRequest(namespace_id=ns, pin_ids=[pid]))

    return [
        ("Lookup", "session", s_lookup, s_sizes["Lookup"]),
        ("ReserveStore", "session", s_store, s_sizes["ReserveStore"]),
        ("ReserveLoad", "session", s_load, s_sizes["ReserveLoad"]),
    ]


def _stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "p50_us": round(_quantile(s, 0.5) * 1e6, 1),
        "p99_us": round(_quantile(s, 0.99) * 1e6, 1),
        "mean_us": round(sum(s) / len(s) * 1e6, 1),
    }


def _client_ops(client: PoolClient, committed: list[bytes], n: int) -> list[tuple[str, Op]]:
    """The connector's `PoolClient` calls for n keys (each returns its untimed undo)."""
    reg = client.registration
    assert reg is not None
    hit = committed[:n]
    new = [make_key((i + (1 << 40)).to_bytes(32, "big"), 0) for i in range(n)]

    def check(cond: bool, what: str) -> None:
        if not cond:
            raise SystemExit(f"unexpected answer: {what}")

    def c_lookup() -> None:
        check(client.lookup([hit]) == [n], "lookup miss")

    def c_store() -> Callable[[], None]:
        r = client.reserve_store(new)
        check(len(r.slots) == n, "store not NEW")
        return lambda: client.abort_store(
            reg.namespace_id, r.store_id, epoch=FENCE["sidecar_epoch"], engine=ENGINE
        )

    def c_load() -> Callable[[], None]:
        pin, slots, _ = client.reserve_load(hit)
        check(len(slots) == n, "load miss")
        return lambda: client.release([pin])

    return [("Lookup", c_lookup), ("ReserveStore", c_store), ("ReserveLoad", c_load)]


def connector_client(
    target: str, client_class: type[PoolClient] = PoolClient, **options: Any
) -> tuple[PoolClient, list[bytes]]:
    """A registered `PoolClient` (the connector's) with max(SIZES) committed keys (the same
    keys in the same namespace on every call: a second client finds them committed).
    `options` go to the constructor (e.g. framed=False)."""
    client = client_class(
        target.removeprefix("unix:"), "bench/client", rpc_timeout_s=5, engine=ENGINE, **options
    )
    spec = build_spec(
        model="bench-client",
        dtype="bfloat16",
        kv_layout="LBHNC/packed-kv",
        block_size=16,
        chunk_blocks=1,
        tp_size=1,
        hash_algo="sha256",
        group_specs=["Full:w0"],
    )
    reg = client.register(spec, 1, SLOT_BYTES)
    _hold(reg.regions[0].path, reg.engine_lock_base, reg.epoch)
    committed = [make_key(i.to_bytes(32, "big"), 0) for i in range(max(SIZES))]
    res = client.reserve_store(committed)
    if res.store_id:
        client.commit_store(reg.namespace_id, res.store_id, 0, epoch=reg.epoch, engine=ENGINE)
    return client, committed


def _row(
    op: str, mode: str, n: int, samples: list[float], floor_samples: list[float], sizes: Any
) -> dict[str, Any]:
    r: dict[str, Any] = {"op": op, "mode": mode, "keys": n, "calls": len(samples)}
    r.update(_stats(samples))
    r["request_bytes"], r["reply_bytes"] = sizes
    line = (
        f"  {op:<12} {mode:<7} {n:>5} keys  p50 {r['p50_us']:>8.1f} µs  p99 {r['p99_us']:>8.1f} µs"
    )
    if floor_samples:
        f = _stats(floor_samples)
        r["floor"] = f
        r["above_floor_p50_us"] = round(r["p50_us"] - f["p50_us"], 1)
        r["above_floor_p99_us"] = round(r["p99_us"] - f["p99_us"], 1)
        r["x_floor_p50"] = round(r["p50_us"] / f["p50_us"], 2)
        r["x_floor_p99"] = round(r["p99_us"] / f["p99_us"], 2)
        line += f"  (floor p50 {f['p50_us']:>6.1f} p99 {f['p99_us']:>6.1f})"
    print(line, file=sys.stderr, flush=True)
    return r


def run(
    target: str,
    calls: int,
    warmup: int,
    echo_targets: tuple[str, str] | None = None,
    sizes: tuple[int, ...] = SIZES,
) -> list[dict[str, Any]]:
    channel = grpc.insecure_channel(target)
    stub = pb_grpc.KVPoolStub(channel)
    echo_channel = grpc.insecure_channel(echo_targets[0]) if echo_targets else None
    echo = EchoCaller(echo_channel) if echo_channel else None
    framed_echo = FramedEchoCaller(echo_targets[1]) if echo_targets else None
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
            spec=spec,
            num_ranks=1,
            slot_bytes_per_rank=SLOT_BYTES,
            client_name="bench",
            engine=ENGINE,
        ),
        timeout=10,
    )
    ns, cid = reg.namespace_id, reg.client_id
    _hold(reg.regions[0].path, reg.engine_lock_base, reg.sidecar_epoch)
    committed = _keys(0, max(SIZES))
    res = stub.ReserveStore(
        pb.ReserveStoreRequest(namespace_id=ns, client_id=cid, keys=committed), timeout=10
    )
    stub.CommitStore(
        pb.CommitStoreRequest(namespace_id=ns, store_id=res.store_id, rank=0, **FENCE), timeout=10
    )
    session = SessionCaller(stub, cid)
    clients = {  # the connector's client on the gRPC Session stream, then on the framed socket
        "client": connector_client(target, framed=False),
        "framed": connector_client(target, framed=True),
    }
    assert clients["framed"][0].transport == "framed", "the sidecar offered no framed socket"
    client_keys = clients["client"][1]
    key_extra = len(client_keys[0]) - KEY_SIZE  # the client's keys carry the KV group too
    results = []
    for n in sizes:
        session_sizes = {}
        for op, mode, fn, sizes in _ops(session, ns, cid, committed, n):
            floor = echo.op(*sizes) if echo else None
            samples, floor_samples = _time(calls, warmup, fn, floor)
            results.append(_row(op, mode, n, samples, floor_samples, sizes))
            if mode == "session":
                session_sizes[op] = sizes
        for mode, (client, keys) in clients.items():
            for op, fn in _client_ops(client, keys, n):
                req_bytes, reply_bytes = session_sizes[op]
                sizes = (req_bytes + n * key_extra, reply_bytes)  # same reply as the bare session
                if mode == "framed":  # each transport against its own floor
                    floor = framed_echo.op(*sizes) if framed_echo else None
                else:
                    floor = echo.op(*sizes) if echo else None
                samples, floor_samples = _time(calls, warmup, fn, floor)
                results.append(_row(op, mode, n, samples, floor_samples, sizes))
    for client, _ in clients.values():
        client.close()
    session.close()
    channel.close()
    if echo is not None and echo_channel is not None:
        echo.close()
        echo_channel.close()
    if framed_echo is not None:
        framed_echo.close()
    return results


def _table(results: list[dict[str, Any]]) -> str:
    floor = any("floor" in r for r in results)
    head = (
        f"{'op':<12} {'mode':<8} {'keys':>5} {'calls':>6} "
        f"{'p50 µs':>9} {'p99 µs':>9} {'mean µs':>9}"
    )
    if floor:
        head += (
            f" {'floor p50':>10} {'floor p99':>10} {'+p50':>7} {'+p99':>7} "
            f"{'x p50':>6} {'x p99':>6}"
        )
    lines = [head]
    for r in results:
        line = (
            f"{r['op']:<12} {r['mode']:<8} {r['keys']:>5} {r['calls']:>6} {r['p50_us']:>9.1f} "
            f"{r['p99_us']:>9.1f} {r['mean_us']:>9.1f}"
        )
        if "floor" in r:
            f = r["floor"]
            line += (
                f" {f['p50_us']:>10.1f} {f['p99_us']:>10.1f} {r['above_floor_p50_us']:>7.1f} "
                f"{r['above_floor_p99_us']:>7.1f} {r['x_floor_p50']:>6.2f} "
                f"{r['x_floor_p99']:>6.2f}"
            )
        lines.append(line)
    if floor:
        lines.append(
            "floor: empty bytes echo (grpc.aio subprocess, Unix socket, same request and reply "
            "sizes; the framed rows: a framed echo served by a thread per connection, like the "
            "sidecar's framed socket), one call after each sidecar call; +: sidecar minus floor; "
            "x: ratio"
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
    parser.add_argument(
        "--sizes",
        default=",".join(map(str, SIZES)),
        help=f"keys per call, comma-separated, each at most {max(SIZES)} (default %(default)s)",
    )
    parser.add_argument(
        "--no-floor", action="store_true", help="skip the empty-echo floor measured alongside"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "sidecar_rpc.json")
    ns = parser.parse_args()
    try:
        sizes = tuple(int(x) for x in ns.sizes.split(","))
    except ValueError:
        parser.error(f"--sizes: comma-separated integers, got {ns.sizes!r}")
    if not all(1 <= n <= max(SIZES) for n in sizes):
        parser.error(f"--sizes: each must be in 1..{max(SIZES)}")
    pool_dir = ns.pool_dir or Path(tempfile.mkdtemp(prefix="kvo-bench-pool-"))
    pool_dir = Path(tempfile.mkdtemp(prefix="kvo-bench-pool-", dir=pool_dir))
    try:
        with sidecar(pool_dir, ns.pool_size) as target:
            if ns.no_floor:
                results = run(target, ns.calls, ns.warmup, sizes=sizes)
            else:
                with echo_server() as echo_targets:
                    results = run(target, ns.calls, ns.warmup, echo_targets, sizes)
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
        "floor": None
        if ns.no_floor
        else "empty bytes echo: grpc.aio subprocess on a Unix socket, same request and reply "
        "sizes, no protobuf; for the framed rows a framed echo (a blocking thread per "
        "connection) in the same subprocess; one echo call after each sidecar call",
        "calls": ns.calls,
        "warmup": ns.warmup,
        "key_size": KEY_SIZE,
        "results": results,
    }
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
