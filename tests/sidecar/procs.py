"""Helpers for process tests: a real sidecar (subprocess or in-process thread) and real clients.

- `sidecar_process(...)`: runs `kvoffload sidecar` as a subprocess on a Unix socket, waits for
  health SERVING with a deadline, stops it with SIGTERM; stderr is kept for failure messages.
- `ServerThread`: the same server in this process (its own event loop in a thread), so a test can
  check the live Pool (`pool_invariants.check_invariants`) while clients talk to it over the
  socket.
- `Client`: a small sync gRPC client with key packing helpers.
- `python tests/sidecar/procs.py pin|store ...`: client actions run as separate processes (killed
  or exiting on purpose by lifecycle tests).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import queue
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvoffload.v1 import pool_pb2 as pb
from kvoffload.v1 import pool_pb2_grpc as pb_grpc
from kvoffload_cli.sidecar_child import stop_process  # re-exported for the process tests
from kvoffload_connector.worker.engine_lock import EngineLock, lock_offset

KEY_SIZE = 32
SLOT_BYTES = 64 << 10
HERE = Path(__file__).resolve()


def wire_slots(packed: bytes) -> list[int]:
    """Slot numbers of a reply as the contract packs them: 4-byte little-endian uint32s."""
    assert len(packed) % 4 == 0, f"{len(packed)} bytes of slots"
    return list(struct.unpack(f"<{len(packed) // 4}I", packed))


def kvoffload_command() -> list[str]:
    """The installed console script next to this interpreter, else the module."""
    script = Path(sys.executable).parent / "kvoffload"
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvoffload_cli.main"]


def short_dir(prefix: str = "kvo-") -> Path:
    """A short temp dir: Unix socket paths must stay under 108 bytes (pytest's tmp_path may not)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


@contextlib.contextmanager
def socket_dir() -> Iterator[Path]:
    path = short_dir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def keys(*ints: int, key_size: int = KEY_SIZE) -> bytes:
    """Packed keys from small integers (key i = i big-endian on key_size bytes)."""
    return b"".join(i.to_bytes(key_size, "big") for i in ints)


def spec(
    model: str = "tiny-llama", *, tp_size: int = 1, key_size: int = KEY_SIZE, **extra: str
) -> pb.NamespaceSpec:
    return pb.NamespaceSpec(
        model=model,
        dtype="bfloat16",
        kv_layout="LBHNC/packed-kv",
        block_size=16,
        chunk_blocks=1,
        tp_size=tp_size,
        hash_algo="sha256",
        key_size=key_size,
        extra=extra,
    )


def health_status(target: str, service: str = "", timeout: float = 1.0) -> int | None:
    """The health status of `service`, or None when the server does not answer."""
    try:
        with grpc.insecure_channel(target) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
    except grpc.RpcError:
        return None
    return int(resp.status)


def wait_serving(target: str, deadline_s: float, *, alive: Any = None) -> None:
    """Poll health until SERVING; AssertionError after the deadline or when `alive()` is False."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if health_status(target, timeout=0.5) == health_pb2.HealthCheckResponse.SERVING:
            return
        if alive is not None and not alive():
            raise AssertionError("the sidecar exited before serving")
        time.sleep(0.05)
    raise AssertionError(f"{target} not SERVING after {deadline_s}s")


@dataclass
class SidecarProc:
    """A running `kvoffload sidecar` subprocess."""

    proc: subprocess.Popen[bytes]
    socket: Path
    pool_dir: Path
    stderr_path: Path
    args: list[str] = field(default_factory=list)

    @property
    def target(self) -> str:
        return f"unix:{self.socket}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def terminate(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait; returns the exit code (kills and fails after `timeout`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
            raise AssertionError(
                f"sidecar ignored SIGTERM for {timeout}s:\n{self.stderr()}"
            ) from None


@contextlib.contextmanager
def sidecar_process(
    pool_dir: Path,
    sock_dir: Path,
    *args: str,
    pool_size: str = "16Mi",
    ready_timeout: float = 30.0,
    env: dict[str, str] | None = None,
    wrap: Sequence[str] = (),
) -> Iterator[SidecarProc]:
    """Start `kvoffload sidecar`, wait for SERVING, yield, then SIGTERM (kill after 15 s).
    `wrap`: a command that execs the rest (e.g. joins a cgroup first)."""
    sock = sock_dir / "pool.sock"
    stderr_path = sock_dir / f"sidecar-{time.monotonic_ns()}.log"
    argv = [
        *kvoffload_command(),
        "sidecar",
        "--pool-size",
        pool_size,
        "--pool-dir",
        str(pool_dir),
        "--socket",
        str(sock),
        "--log-level",
        "DEBUG",
        *args,
    ]
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen(
            [*wrap, *argv], stdout=err, stderr=err, env={**os.environ, **(env or {})}
        )
    handle = SidecarProc(proc, sock, pool_dir, stderr_path, argv)
    try:
        try:
            wait_serving(handle.target, ready_timeout, alive=lambda: proc.poll() is None)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- sidecar stderr ---\n{handle.stderr()}") from None
        yield handle
    finally:
        stop_process(proc)


class ServerThread:
    """The real server and Pool in this process, on their own event loop thread (with the
    runtime's client reaper, which releases detached clients after their grace)."""

    def __init__(self, config: Any) -> None:
        from kvoffload_sidecar.pool import Pool
        from kvoffload_sidecar.runtime import pool_settings

        self.config = config
        self.pool = Pool(pool_settings(config))
        self.sidecar: Any = None
        self._reaper: Any = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvoffload-server", daemon=True
        )

    @property
    def target(self) -> str:
        return f"unix:{self.config.socket}"

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def __enter__(self) -> ServerThread:
        from kvoffload_sidecar.runtime import reap_forever
        from kvoffload_sidecar.server import create_server

        self.pool.start()
        self._thread.start()

        async def build() -> Any:
            sidecar = create_server(self.config, self.pool)
            await sidecar.start()
            self._reaper = asyncio.create_task(
                reap_forever(self.pool, self.config.reap_interval_s, sidecar)
            )
            return sidecar

        self.sidecar = self.call(build())
        return self

    def drain(self, grace: float = 1.0) -> None:
        self.call(self.sidecar.drain(grace))

    def __exit__(self, *exc: object) -> None:
        try:
            if self._reaper is not None:
                self._loop.call_soon_threadsafe(self._reaper.cancel)
            if self.sidecar is not None:
                self.drain()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()
            self.pool.close()


def server_config(pool_dir: Path, sock_dir: Path, **overrides: Any) -> Any:
    from kvoffload_sidecar.config import SidecarConfig

    fields: dict[str, Any] = {
        "pool_size": 16 << 20,
        "pool_dir": pool_dir,
        "socket": sock_dir / "pool.sock",
        "detach_grace_s": 0.2,  # released soon after a session ends (tests wait for it)
    }
    fields.update(overrides)
    return SidecarConfig(**fields)


def wait_ready(client: Client, deadline_s: float = 30.0) -> pb.StatsResponse:
    """Poll Stats until the pool is pre-faulted (pool_ready)."""
    end = time.monotonic() + deadline_s
    while True:
        stats = client.stats()
        if stats.pool_ready or time.monotonic() > end:
            assert stats.pool_ready, (
                f"pool not ready after {deadline_s}s: {stats.prefaulted_bytes} bytes"
            )
            return stats
        time.sleep(0.05)


def hold_engine_locks(resp: pb.RegisterResponse, num_ranks: int) -> list[EngineLock]:
    """Hold every rank's lock of the registration's engine from this process, as the ranks'
    workers do (the sidecar grants store reservations only while each rank holds its lock)."""
    path = resp.regions[0].path
    return [
        EngineLock(path, lock_offset(resp.engine_lock_base, resp.engine, r))
        for r in range(num_ranks)
    ]


class Client:
    """A sync client on one channel; methods raise grpc.RpcError like any stub. It is an
    engine of its own (a random key) whose every rank is this process: it holds the ranks'
    engine locks from its registration until `close` (or its process's death)."""

    def __init__(self, target: str, timeout: float = 10.0, *, engine: int | None = None) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.KVPoolStub(self.channel)
        self.timeout = timeout
        self.namespace_id = ""
        self.client_id = 0
        self.engine = engine if engine is not None else random.randrange(1, 1 << 34)
        self.epoch = 0
        self.locks: list[EngineLock] = []

    def close(self) -> None:
        self.release_locks()
        self.channel.close()

    def release_locks(self) -> None:
        """As if every rank of the engine exited."""
        for lock in self.locks:
            lock.release()
        self.locks = []

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def register(
        self,
        the_spec: pb.NamespaceSpec | None = None,
        *,
        num_ranks: int = 1,
        slot_bytes: int = SLOT_BYTES,
        name: str = "test",
    ) -> pb.RegisterResponse:
        resp = self.stub.Register(
            pb.RegisterRequest(
                spec=the_spec or spec(),
                num_ranks=num_ranks,
                slot_bytes_per_rank=slot_bytes,
                client_name=name,
                engine=self.engine,
            ),
            timeout=self.timeout,
        )
        self.namespace_id, self.client_id = resp.namespace_id, resp.client_id
        self.epoch = resp.sidecar_epoch
        if self.engine and resp.regions:
            self.release_locks()  # a new registration: its generation's lock bytes
            self.locks = hold_engine_locks(resp, num_ranks)
        return resp

    def lookup(self, *queries: bytes) -> list[int]:
        req = pb.LookupRequest(
            namespace_id=self.namespace_id, queries=[pb.KeyList(keys=q) for q in queries]
        )
        return list(self.stub.Lookup(req, timeout=self.timeout).hit_counts)

    def reserve_store(self, packed: bytes) -> pb.ReserveStoreResponse:
        req = pb.ReserveStoreRequest(
            namespace_id=self.namespace_id, client_id=self.client_id, keys=packed
        )
        return self.stub.ReserveStore(req, timeout=self.timeout)

    def commit(self, store_id: int, rank: int = 0) -> bool:
        req = pb.CommitStoreRequest(
            namespace_id=self.namespace_id,
            store_id=store_id,
            rank=rank,
            sidecar_epoch=self.epoch,
            engine=self.engine,
        )
        return self.stub.CommitStore(req, timeout=self.timeout).visible

    def abort(self, store_id: int) -> int:
        req = pb.AbortStoreRequest(
            namespace_id=self.namespace_id,
            store_id=store_id,
            sidecar_epoch=self.epoch,
            engine=self.engine,
        )
        return self.stub.AbortStore(req, timeout=self.timeout).freed_slots

    def store(self, packed: bytes, ranks: int = 1) -> pb.ReserveStoreResponse:
        """Reserve and commit on every rank; returns the reservation."""
        res = self.reserve_store(packed)
        if res.store_id:
            for rank in range(ranks):
                self.commit(res.store_id, rank)
        return res

    def reserve_load(self, packed: bytes) -> pb.ReserveLoadResponse:
        req = pb.ReserveLoadRequest(
            namespace_id=self.namespace_id, client_id=self.client_id, keys=packed
        )
        return self.stub.ReserveLoad(req, timeout=self.timeout)

    def release(self, *pin_ids: int) -> int:
        req = pb.ReleaseRequest(
            namespace_id=self.namespace_id, client_id=self.client_id, pin_ids=pin_ids
        )
        return self.stub.Release(req, timeout=self.timeout).released_slots

    def stats(self) -> pb.StatsResponse:
        return self.stub.Stats(pb.StatsRequest(), timeout=self.timeout)

    def namespace_stats(self) -> pb.NamespaceStats:
        for ns in self.stats().namespaces:
            if ns.namespace_id == self.namespace_id:
                return ns
        raise AssertionError(f"namespace {self.namespace_id} not in Stats")


class Session:
    """A Session stream driven request by request (sync API: a queue feeds the request iterator)."""

    def __init__(self, client: Client) -> None:
        self._requests: queue.Queue[pb.SessionRequest | None] = queue.Queue()
        self._responses = client.stub.Session(iter(self._requests.get, None))
        self._seq = 0

    def send(self, **call: Any) -> pb.SessionResponse:
        self._seq += 1
        self._requests.put(pb.SessionRequest(seq=self._seq, **call))
        resp = next(self._responses)
        assert resp.seq == self._seq, (resp.seq, self._seq)
        return resp

    def close(self) -> None:
        self._requests.put(None)
        with contextlib.suppress(StopIteration, grpc.RpcError):
            next(self._responses)

    def cancel(self) -> None:
        self._responses.cancel()


class FramedSession:
    """The Session protocol on the sidecar's framed socket, written here from the contract
    (4-byte little-endian length + message), independent of the connector's client."""

    def __init__(self, path: Path | str, timeout: float = 10.0) -> None:
        import socket

        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(str(path))
        self._seq = 0

    def send_raw(self, payload: bytes, length: int | None = None) -> None:
        size = len(payload) if length is None else length
        self.sock.sendall(struct.pack("<I", size) + payload)

    def read(self) -> pb.SessionResponse | None:
        """The next answer; None when the sidecar closed the connection."""
        header = self._exactly(4)
        if header is None:
            return None
        body = self._exactly(struct.unpack("<I", header)[0])
        assert body is not None, "connection closed inside a frame"
        return pb.SessionResponse.FromString(body)

    def _exactly(self, n: int) -> bytes | None:
        data = b""
        while len(data) < n:
            try:
                chunk = self.sock.recv(n - len(data))
            except ConnectionResetError:  # closed by the peer with our bytes still unread
                chunk = b""
            if not chunk:
                assert not data, "connection closed inside a frame"
                return None
            data += chunk
        return data

    def send(self, **call: Any) -> pb.SessionResponse:
        self._seq += 1
        self.send_raw(pb.SessionRequest(seq=self._seq, **call).SerializeToString())
        resp = self.read()
        assert resp is not None, "the sidecar closed the framed session"
        assert resp.seq == self._seq, (resp.seq, self._seq)
        return resp

    def close(self) -> None:
        self.sock.close()

    def cancel(self) -> None:
        """Like a dropped connection: half a frame, then gone."""
        with contextlib.suppress(OSError):
            self.sock.sendall(struct.pack("<I", 100) + b"\x08")
        self.sock.close()


# -- client actions as separate processes ----------------------------------------------------


def _cmd_pin(ns: argparse.Namespace) -> None:
    """Register, store+commit keys 0..n-1, open a Session, pin them in-session, report, wait."""
    client = Client(f"unix:{ns.socket}")
    reg = client.register(name="pinner")
    packed = keys(*range(ns.n))
    client.store(packed)
    session = Session(client)
    attached = session.send(attach=pb.AttachRequest(client_id=client.client_id))
    assert attached.WhichOneof("result") == "attach", attached
    pinned = session.send(
        reserve_load=pb.ReserveLoadRequest(namespace_id=reg.namespace_id, keys=packed)
    )
    print(
        json.dumps(
            {"pin_id": pinned.reserve_load.pin_id, "slots": wire_slots(pinned.reserve_load.slots)}
        ),
        flush=True,
    )
    time.sleep(ns.hold)


def _cmd_store(ns: argparse.Namespace) -> None:
    """Register, store+commit keys first..first+n-1, report the registration, exit."""
    client = Client(f"unix:{ns.socket}")
    reg = client.register(name="storer")
    client.store(keys(*range(ns.first, ns.first + ns.n)))
    print(
        json.dumps(
            {
                "namespace_id": reg.namespace_id,
                "committed_blocks": reg.committed_blocks,
                "hits": client.lookup(keys(*range(ns.first, ns.first + ns.n)))[0],
            }
        ),
        flush=True,
    )
    client.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="client actions for lifecycle tests")
    sub = parser.add_subparsers(dest="cmd", required=True)
    pin = sub.add_parser("pin")
    pin.add_argument("--socket", required=True)
    pin.add_argument("--n", type=int, default=8)
    pin.add_argument("--hold", type=float, default=60.0)
    store = sub.add_parser("store")
    store.add_argument("--socket", required=True)
    store.add_argument("--first", type=int, default=0)
    store.add_argument("--n", type=int, default=8)
    ns = parser.parse_args(argv)
    {"pin": _cmd_pin, "store": _cmd_store}[ns.cmd](ns)


def run_client(*args: str, timeout: float = 30.0) -> dict[str, Any]:
    """Run a client action to completion; its JSON line."""
    done = subprocess.run(
        [sys.executable, str(HERE), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def start_client(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(HERE), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


if __name__ == "__main__":
    main()
