"""Round trips to a real `kvoffload sidecar` through the connector's own `PoolClient` on the
framed session socket: Lookup, ReserveStore (each undone by an untimed AbortStore) and
ReserveLoad (each undone by an untimed Release) of 1, 64 and 1,024 keys, p50/p99. After each
call, one call of the transport's floor: a framed echo (a subprocess serving the framed protocol
as the sidecar does, no pool work, no protobuf) of the same request and reply sizes.

    python -m bench sidecar_rpc [--calls 2000] [--sizes 1,64,1024] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvoffload.v1 import pool_pb2 as pb
from kvoffload_cli.sidecar_child import SidecarProcess
from kvoffload_connector.common.client import PoolClient
from kvoffload_connector.common.keys import build_spec, make_key
from kvoffload_connector.worker.engine_lock import EngineLock, lock_offset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import percentile, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SIZES = (1, 64, 1024)
ENGINE = 1  # the bench process is every rank of one engine: it holds the rank's lock
Op = Callable[[], Callable[[], None] | None]  # one timed call; returns its untimed undo


# -- the transport's floor: a framed echo --------------------------------------------------------


def _exactly(conn: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return bytes(data)


def _serve_echo(path: str) -> None:
    """Subprocess: a framed echo served like the sidecar's framed socket (a blocking thread per
    connection reading a 4-byte little-endian length and the frame, answering one frame). A
    request names its reply's size in its first 4 bytes."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(ConnectionError, OSError):
            while True:
                req = _exactly(conn, int.from_bytes(_exactly(conn, 4), "little"))
                reply = bytes(int.from_bytes(req[:4], "little"))
                conn.sendall(len(reply).to_bytes(4, "little") + reply)

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


@contextlib.contextmanager
def echo_server() -> Iterator[str]:
    """The framed echo's socket path, served by a subprocess."""
    with tempfile.TemporaryDirectory(prefix="kvo-floor-") as work:
        path = os.path.join(work, "echo.session")
        proc = mp.get_context("spawn").Process(target=_serve_echo, args=(path,), daemon=True)
        proc.start()
        try:
            deadline = time.monotonic() + 30
            while not os.path.exists(path):
                if time.monotonic() > deadline:
                    raise SystemExit("the framed echo did not start")
                time.sleep(0.01)
            yield path
        finally:
            proc.kill()
            proc.join(5)


def echo_call(sock: socket.socket, request_bytes: int, reply_bytes: int) -> Callable[[], None]:
    """One echo exchange of these sizes, sent and read like the connector's FramedSession."""
    payload = reply_bytes.to_bytes(4, "little") + bytes(max(0, request_bytes - 4))
    message = len(payload).to_bytes(4, "little") + payload

    def call() -> None:
        sock.sendall(message)
        _exactly(sock, int.from_bytes(_exactly(sock, 4), "little"))

    return call


# -- the sidecar, through the connector's client -----------------------------------------------


def connector_client(path: str) -> tuple[PoolClient, list[bytes], Any]:
    """A registered `PoolClient` on the framed socket with max(SIZES) committed keys, and the
    engine lock it holds (the sidecar grants stores only to a live engine's rank)."""
    client = PoolClient(path, "bench/client", rpc_timeout_s=5, engine=ENGINE, framed=True)
    spec = build_spec(
        model="bench-client", dtype="bfloat16", kv_layout="LBHNC/packed-kv", block_size=16,
        chunk_blocks=1, tp_size=1, hash_algo="sha256", group_specs=["Full:w0"],
    )  # fmt: skip
    reg = client.register(spec, 1, 16 << 10)
    if client.transport != "framed":
        raise SystemExit("the sidecar offered no framed session socket")
    lock = EngineLock(reg.regions[0].path, lock_offset(reg.engine_lock_base, ENGINE, 0))
    committed = [make_key(i.to_bytes(32, "big"), 0) for i in range(max(SIZES))]
    res = client.reserve_store(committed)
    client.commit_store(reg.namespace_id, res.store_id, 0, epoch=reg.epoch, engine=ENGINE)
    return client, committed, lock


def client_ops(client: PoolClient, committed: list[bytes], n: int) -> list[tuple[str, Op]]:
    """The connector's calls for n keys (each returns its untimed undo)."""
    reg = client.registration
    assert reg is not None
    hit = committed[:n]
    new = [make_key((i + (1 << 40)).to_bytes(32, "big"), 0) for i in range(n)]

    def check(cond: bool, what: str) -> None:
        if not cond:
            raise SystemExit(f"unexpected answer: {what}")

    def lookup() -> None:
        check(client.lookup([hit]) == [n], "lookup miss")

    def store() -> Callable[[], None]:
        r = client.reserve_store(new)
        check(len(r.slots) == n, "store not NEW")
        return lambda: client.abort_store(
            reg.namespace_id, r.store_id, epoch=reg.epoch, engine=ENGINE
        )

    def load() -> Callable[[], None]:
        pin, slots, _ = client.reserve_load(hit)
        check(len(slots) == n, "load miss")
        return lambda: client.release([pin])

    return [("Lookup", lookup), ("ReserveStore", store), ("ReserveLoad", load)]


def frame_sizes(client: PoolClient, op: Op) -> tuple[int, int]:
    """(request bytes, reply bytes) of the session message one call of `op` exchanges."""
    session = client._session
    real, seen = session.call, []

    def spy(timeout_s: float, **call: Any) -> pb.SessionResponse:
        resp = real(timeout_s, **call)
        seen.append((pb.SessionRequest(seq=1 << 20, **call).ByteSize(), resp.ByteSize()))
        return resp

    session.call = spy
    try:
        undo = op()
    finally:
        del session.call
    if undo is not None:
        undo()
    return seen[0]


def timed(calls: int, warmup: int, op: Op, floor: Callable[[], None]) -> tuple[list, list]:
    """Run `op` warmup+calls times, each followed by its untimed undo and one timed `floor`
    call: seconds per timed call (op, floor)."""
    samples: list[float] = []
    floor_samples: list[float] = []
    perf = time.perf_counter
    for i in range(warmup + calls):
        start = perf()
        undo = op()
        elapsed = perf() - start
        if undo is not None:
            undo()
        start = perf()
        floor()
        if i >= warmup:
            samples.append(elapsed)
            floor_samples.append(perf() - start)
    return samples, floor_samples


def run(path: str, echo: str, calls: int, warmup: int, sizes: tuple[int, ...]) -> list:
    client, committed, lock = connector_client(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(echo)
    rows = []
    try:
        for n in sizes:
            for op, fn in client_ops(client, committed, n):
                size = frame_sizes(client, fn)
                samples, floor = timed(calls, warmup, fn, echo_call(sock, *size))
                row = {"op": op, "keys": n, "calls": len(samples)}
                for name, values in (("", samples), ("floor_", floor)):
                    row |= {
                        f"{name}p{q}_us": round(percentile(values, q) * 1e6, 1) for q in (50, 99)
                    }
                rows.append(row | {"request_bytes": size[0], "reply_bytes": size[1]})
                print(rows[-1], file=sys.stderr, flush=True)
    finally:
        sock.close()
        client.close()
        lock.release()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per row")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="keys per call")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "sidecar_rpc.json")
    ns = parser.parse_args()
    try:
        sizes = tuple(int(x) for x in ns.sizes.split(","))
    except ValueError:
        parser.error(f"--sizes: comma-separated integers, got {ns.sizes!r}")
    if not all(1 <= n <= max(SIZES) for n in sizes):
        parser.error(f"--sizes: each must be in 1..{max(SIZES)}")
    with SidecarProcess("256Mi") as sidecar, echo_server() as echo:
        rows = run(sidecar.socket, echo, ns.calls, ns.warmup, sizes)
    extra = {"calls": ns.calls, "warmup": ns.warmup, "transport": "framed session socket"}
    report("sidecar_rpc", rows, ns.out, extra=extra)


if __name__ == "__main__":
    main()
