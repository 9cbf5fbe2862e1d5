"""Fuzz: >= 10,000 random and malformed calls against a real server; it stays up and consistent.

Requests mix valid ids (so deep paths are reached: stores, commits, pins, evictions) with random
bytes, wrong key lengths, unknown or zero ids, huge counts and random oneofs in sessions (gRPC
Session streams and the framed session socket), plus garbage and cut frames on the latter.
Every answer must be OK or one of the documented codes, never UNKNOWN or INTERNAL, and the live
Pool's invariants must hold afterwards (the server runs in-process for that check).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from kvoffload.v1 import pool_pb2 as pb
from pool_invariants import check_invariants
from procs import (
    Client,
    FramedSession,
    ServerThread,
    Session,
    server_config,
    socket_dir,
    spec,
    wait_ready,
)

pytestmark = [pytest.mark.process, pytest.mark.timeout(180)]

N_CALLS = 10_000
SEED = 20261122
KEY_SIZE = 32
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
}
ALLOWED_NUMBERS = {code.value[0] for code in ALLOWED}


class Fuzzer:
    """Random requests biased towards ids the server actually issued."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.namespaces: list[str] = []
        self.clients: list[int] = []
        self.pairs: list[tuple[str, int]] = []  # (namespace, client) as registered
        self.pins: dict[str, list[int]] = {}  # per namespace
        self.stores: dict[str, list[int]] = {}
        self.key_pool = [rng.randbytes(KEY_SIZE) for _ in range(400)]
        self._pair: tuple[str, int] | None = None
        self.epochs: list[int] = []  # sidecar epochs and engines the registrations named
        self.engines: list[int] = []

    def pair(self) -> tuple[str, int]:
        """Mostly a registered (namespace, client) pair; else any mix of known and junk ids."""
        if self.pairs and self.rng.random() < 0.7:
            return self.rng.choice(self.pairs)
        return self.namespace(), self.an_id(self.clients)

    def pick(self, known: list[Any], junk: Callable[[], Any]) -> Any:
        return self.rng.choice(known) if known and self.rng.random() < 0.75 else junk()

    def namespace(self) -> str:
        r = self.rng
        return self.pick(
            self.namespaces,
            lambda: r.choice(
                [
                    "",
                    r.randbytes(16).hex(),
                    "x" * r.randint(1, 300),
                    "ünï\u2603",
                    self.namespaces[0] + "0" if self.namespaces else "a",
                ]
            ),
        )

    def an_id(self, known: list[int]) -> int:
        r = self.rng
        return self.pick(
            known, lambda: r.choice([0, 1, r.randrange(1 << 64), (1 << 64) - 1, r.randrange(100)])
        )

    def keys(self) -> bytes:
        r = self.rng
        roll = r.random()
        if roll < 0.6:  # well-formed, often overlapping keys
            return b"".join(r.choice(self.key_pool) for _ in range(r.choice([0, 1, 2, 8, 64, 200])))
        if roll < 0.8:  # wrong length
            return r.randbytes(r.randint(1, 4 * KEY_SIZE) | 1)
        if roll < 0.95:  # random bytes of a valid length
            return r.randbytes(KEY_SIZE * r.randint(0, 16))
        return bytes(KEY_SIZE * r.choice([65537, 70000]))  # too many keys

    def spec(self) -> pb.NamespaceSpec:
        r = self.rng
        if r.random() < 0.6:
            return spec(r.choice(["tiny-llama", "other-model"]), tp_size=r.choice([1, 1, 2]))
        return pb.NamespaceSpec(
            model=r.choice(["", "m", "x" * 5000, r.randbytes(8).hex()]),
            dtype=r.choice(["", "bfloat16", "\x00"]),
            kv_layout=r.choice(["", "LBHNC"]),
            block_size=r.choice([0, 1, 16, (1 << 32) - 1]),
            chunk_blocks=r.choice([0, 1, 4]),
            tp_size=r.choice([0, 1, 2, 1000]),
            hash_algo=r.choice(["", "sha256"]),
            key_size=r.choice([0, 1, 32, 256, 257, (1 << 32) - 1]),
            extra={
                r.choice(["", "a", "b" * 10]): r.choice(["", "v"]) for _ in range(r.randint(0, 70))
            },
        )

    def request(self) -> tuple[str, Any]:
        """(method, request) for a unary call."""
        r = self.rng
        method = r.choices(
            [
                "Register",
                "Lookup",
                "ReserveLoad",
                "Release",
                "ReserveStore",
                "CommitStore",
                "AbortStore",
                "Stats",
            ],
            weights=[1, 4, 3, 2, 4, 3, 2, 0.2],
        )[0]
        return method, self.body(method)

    def body(self, method: str) -> Any:
        r = self.rng
        if method == "Register":
            return pb.RegisterRequest(
                spec=self.spec() if r.random() < 0.95 else None,
                num_ranks=r.choice([0, 1, 1, 2, 65, (1 << 32) - 1]),
                slot_bytes_per_rank=r.choice(
                    [0, 15, 16, 4096, 64 << 10, 64 << 10, 1 << 40, (1 << 64) - 1]
                ),
                client_name=r.choice(["fuzz", "", "n" * 300]),
            )
        ns, cid = self.pair()
        if method == "Lookup":
            queries = [pb.KeyList(keys=self.keys()) for _ in range(r.choice([0, 1, 1, 3, 40]))]
            return pb.LookupRequest(namespace_id=ns, queries=queries)
        if method == "ReserveLoad":
            return pb.ReserveLoadRequest(namespace_id=ns, client_id=cid, keys=self.keys())
        if method == "Release":
            pins = [self.an_id(self.pins.get(ns, [])) for _ in range(r.choice([0, 1, 1, 2, 5]))]
            return pb.ReleaseRequest(namespace_id=ns, client_id=cid, pin_ids=pins)
        if method == "ReserveStore":
            return pb.ReserveStoreRequest(namespace_id=ns, client_id=cid, keys=self.keys())
        if method == "CommitStore":
            return pb.CommitStoreRequest(
                namespace_id=ns,
                store_id=self.an_id(self.stores.get(ns, [])),
                rank=r.choice([0, 0, 0, 1, 2, (1 << 32) - 1]),
                sidecar_epoch=self.an_id(self.epochs),
                engine=self.an_id(self.engines),
            )
        if method == "AbortStore":
            return pb.AbortStoreRequest(
                namespace_id=ns,
                store_id=self.an_id(self.stores.get(ns, [])),
                sidecar_epoch=self.an_id(self.epochs),
                engine=self.an_id(self.engines),
            )
        return pb.StatsRequest()

    def forget(self, client_id: int) -> None:
        """A session of this client ended: the pool forgot it (and its pins and stores)."""
        self.pairs = [p for p in self.pairs if p[1] != client_id]

    def learn(self, method: str, request: Any, resp: Any) -> None:
        if method == "Register":
            if resp.namespace_id not in self.namespaces:
                self.namespaces.append(resp.namespace_id)
            self.clients.append(resp.client_id)
            self.pairs.append((resp.namespace_id, resp.client_id))
            self.epochs.append(resp.sidecar_epoch)
            self.engines.append(resp.engine)
        elif method == "ReserveLoad" and resp.pin_id:
            self.pins.setdefault(request.namespace_id, []).append(resp.pin_id)
        elif method == "ReserveStore" and resp.store_id:
            self.stores.setdefault(request.namespace_id, []).append(resp.store_id)

    def session_request(self, seq: int) -> pb.SessionRequest:
        r = self.rng
        kind = r.choice(
            [
                "lookup",
                "reserve_load",
                "release",
                "reserve_store",
                "commit_store",
                "abort_store",
                "attach",
                "none",
            ]
        )
        if kind == "none":
            return pb.SessionRequest(seq=seq)
        if kind == "attach":
            return pb.SessionRequest(
                seq=seq, attach=pb.AttachRequest(client_id=self.an_id(self.clients))
            )
        method = {
            "lookup": "Lookup",
            "reserve_load": "ReserveLoad",
            "release": "Release",
            "reserve_store": "ReserveStore",
            "commit_store": "CommitStore",
            "abort_store": "AbortStore",
        }[kind]
        return pb.SessionRequest(seq=seq, **{kind: self.body(method)})


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    with (
        socket_dir() as sock_dir,
        # no detach grace: a session's end frees its client at once, so the run does not
        # depend on the reaper's timing (the grace has its own tests in test_pool/test_server)
        ServerThread(server_config(tmp_path, sock_dir, max_namespaces=2, detach_grace_s=0)) as srv,
    ):
        yield srv


def test_fuzz_server_stays_up_and_consistent(server: ServerThread) -> None:
    rng = random.Random(SEED)
    fuzz = Fuzzer(rng)
    codes: dict[str, int] = {}
    calls = 0
    with Client(server.target, timeout=20) as client:
        wait_ready(client)
        # a valid namespace and client to start from, with slots small enough to fill the pool
        fuzz.learn("Register", None, client.register(spec("tiny-llama"), slot_bytes=64 << 10))
        while calls < N_CALLS:
            if len(fuzz.pairs) < 3:  # sessions end their clients: keep a few live ones around
                fuzz.learn(
                    "Register", None, client.register(spec("tiny-llama"), slot_bytes=64 << 10)
                )
                calls += 1
            if rng.random() < 0.04:
                framed = server.config.socket.with_name(server.config.socket.name + ".session")
                calls += _fuzz_session(client, fuzz, codes, framed)
                continue
            method, request = fuzz.request()
            try:
                resp = getattr(client.stub, method)(request, timeout=20)
            except grpc.RpcError as exc:
                code = exc.code()
                assert code in ALLOWED, f"{method} answered {code}: {exc.details()}\n{request}"
                assert exc.details(), f"{method} answered {code} without a message"
            else:
                code = grpc.StatusCode.OK
                fuzz.learn(method, request, resp)
            codes[code.name] = codes.get(code.name, 0) + 1
            calls += 1
            if calls % 2500 == 0:
                check_invariants(server.pool)
        check_invariants(server.pool)
        stats = client.stats()
        assert stats.namespaces, "the fuzz never got a namespace"
    assert calls >= N_CALLS
    # the run reached deep paths, not only argument checks
    print("fuzz answers:", dict(sorted(codes.items())))
    assert codes.get("OK", 0) + codes.get("session:OK", 0) > N_CALLS // 5, codes
    assert codes.get("INVALID_ARGUMENT", 0) > 100 and codes.get("NOT_FOUND", 0) > 100, codes
    assert sum(ns.stored_blocks for ns in stats.namespaces) > 0
    assert sum(ns.loaded_blocks for ns in stats.namespaces) > 0
    # still serving normally afterwards
    with Client(server.target) as after:
        after.register(spec("tiny-llama"), slot_bytes=64 << 10)
        assert after.lookup() == []


def _fuzz_session(client: Client, fuzz: Fuzzer, codes: dict[str, int], framed: Path) -> int:
    """One session of random messages, on a gRPC Session stream or (half the time) on the
    framed session socket; returns the number of messages sent."""
    rng = fuzz.rng
    session: Session | FramedSession = (
        FramedSession(framed) if rng.random() < 0.5 else Session(client)
    )
    sent = 0
    try:
        if rng.random() < 0.8 and fuzz.pairs:
            attached = rng.choice(fuzz.pairs)[1]
            resp = session.send(attach=pb.AttachRequest(client_id=attached))
            sent += 1
            _check_session(resp, codes)
            if resp.WhichOneof("result") == "error":
                return sent  # the server ended the stream
            fuzz.forget(attached)  # gone once this stream ends
        else:
            resp = session.send(**_oneof(fuzz.session_request(1)))
            sent += 1
            _check_session(resp, codes)
            if resp.WhichOneof("result") == "error":
                return sent
        for _ in range(rng.randint(1, 40)):
            req = fuzz.session_request(0)
            resp = session.send(**_oneof(req))
            sent += 1
            _check_session(resp, codes)
            kind = resp.WhichOneof("result")
            if kind in ("reserve_load", "reserve_store"):
                method = {"reserve_load": "ReserveLoad", "reserve_store": "ReserveStore"}[kind]
                fuzz.learn(method, getattr(req, kind), getattr(resp, kind))
    finally:
        if rng.random() < 0.5:
            session.close()
        else:
            session.cancel()  # like a dropped connection
    return sent


def _oneof(req: pb.SessionRequest) -> dict[str, Any]:
    kind = req.WhichOneof("call")
    return {kind: getattr(req, kind)} if kind else {}


def _check_session(resp: pb.SessionResponse, codes: dict[str, int]) -> None:
    if resp.WhichOneof("result") == "error":
        assert resp.error.code in ALLOWED_NUMBERS, f"session answered {resp.error}"
        assert resp.error.message
        name = grpc.StatusCode(
            next(c for c in grpc.StatusCode if c.value[0] == resp.error.code)
        ).name
    else:
        assert resp.WhichOneof("result") is not None, "session answer without a result"
        name = "OK"
    codes[f"session:{name}"] = codes.get(f"session:{name}", 0) + 1


def test_undecodable_bytes_do_not_hurt_the_server(server: ServerThread) -> None:
    """Raw garbage as a request body: INVALID_ARGUMENT (not grpc's UNKNOWN); the server lives on."""
    rng = random.Random(SEED + 1)
    with grpc.insecure_channel(server.target) as channel:
        answered = 0
        for i in range(300):
            method = rng.choice(["Lookup", "ReserveStore", "Register", "CommitStore"])
            call = channel.unary_unary(f"/kvoffload.v1.KVPool/{method}")  # bytes in, bytes out
            try:
                call(rng.randbytes(rng.randint(0, 200)) if i % 3 else b"\xff" * 50, timeout=10)
            except grpc.RpcError as exc:
                assert exc.code() in ALLOWED, exc
            answered += 1
        assert answered == 300
    check_invariants(server.pool)
    with Client(server.target) as client:
        assert client.stats().pool_bytes == 16 << 20


def test_garbage_frames_do_not_hurt_the_server(server: ServerThread) -> None:
    """Random bytes, random lengths and cut frames on the framed socket: every answer is a
    documented error, a bad length closes that connection only, the Pool stays consistent."""
    rng = random.Random(SEED + 2)
    framed = server.config.socket.with_name(server.config.socket.name + ".session")
    with Client(server.target, timeout=20) as client:
        wait_ready(client)
        client.register(spec("tiny-llama"), slot_bytes=64 << 10)
        answers = 0
        for _ in range(200):
            session = FramedSession(framed)
            if rng.random() < 0.7:  # a fresh client: an ended session forgets its client at once
                client.register(spec("tiny-llama"), slot_bytes=64 << 10)
                attach = session.send(attach=pb.AttachRequest(client_id=client.client_id))
                _check_session(attach, {})
            for _ in range(rng.randint(1, 10)):
                roll = rng.random()
                if roll < 0.1:
                    session.cancel()  # cut inside a frame
                    break
                try:
                    if roll < 0.2:  # a length above the limit: the server closes the connection
                        session.send_raw(b"", length=rng.randint(33 << 20, (1 << 32) - 1))
                        assert session.read() is None
                        break
                    session.send_raw(rng.randbytes(rng.randint(0, 300)))
                    resp = session.read()
                except (BrokenPipeError, ConnectionResetError):
                    break  # closed by the server after refusing a first frame that was no attach
                if resp is None:
                    break
                _check_session(resp, {})
                answers += 1
            session.close()
        assert answers > 100
        check_invariants(server.pool)
        client.register(spec("tiny-llama"), slot_bytes=64 << 10)  # still serving
