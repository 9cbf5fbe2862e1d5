"""The framed session socket (sidecar frames.py) against the real server in this process:
the Session protocol without gRPC, driven by a client written from the contract alone."""

from __future__ import annotations

import stat
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from kvoffload.v1 import pool_pb2 as pb
from pool_invariants import check_invariants
from procs import (
    Client,
    FramedSession,
    ServerThread,
    keys,
    server_config,
    socket_dir,
    spec,
    wait_ready,
)

pytestmark = [pytest.mark.process, pytest.mark.timeout(60)]
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    with socket_dir() as sock_dir, ServerThread(server_config(tmp_path, sock_dir)) as srv:
        yield srv


@pytest.fixture
def client(server: ServerThread) -> Iterator[Client]:
    with Client(server.target) as c:
        wait_ready(c)
        c.register(spec(), slot_bytes=64 << 10)
        yield c


def framed_path(server: ServerThread) -> Path:
    return server.config.socket.with_name(server.config.socket.name + ".session")


def attached(server: ServerThread, client: Client) -> FramedSession:
    fs = FramedSession(framed_path(server))
    assert fs.send(attach=pb.AttachRequest(client_id=client.client_id)).WhichOneof("result") == (
        "attach"
    )
    return fs


def test_register_names_the_framed_socket_beside_the_grpc_one(server: ServerThread) -> None:
    with Client(server.target) as c:
        wait_ready(c)
        reg = c.stub.Register(
            pb.RegisterRequest(
                spec=spec(), num_ranks=1, slot_bytes_per_rank=64 << 10, client_name="t"
            )
        )
    assert reg.session_socket == "pool.sock.session"
    assert stat.S_ISSOCK(framed_path(server).stat().st_mode)


def test_calls_answer_in_order_and_the_connection_owns_its_pins(
    server: ServerThread, client: Client
) -> None:
    client.store(keys(1, 2, 3))
    fs = attached(server, client)
    ns = client.namespace_id
    lookup = fs.send(
        lookup=pb.LookupRequest(namespace_id=ns, queries=[pb.KeyList(keys=keys(1, 2, 3, 4))])
    )
    assert list(lookup.lookup.hit_counts) == [3]
    pin = fs.send(reserve_load=pb.ReserveLoadRequest(namespace_id=ns, keys=keys(1, 2)))
    assert pin.reserve_load.pin_id and len(pin.reserve_load.slots) == 2 * 4
    assert client.namespace_stats().pinned_slots == 2
    fs.close()  # the connection ends: its client's pins go after the detach grace (0.2 s)
    deadline = time.monotonic() + 10
    while client.namespace_stats().pinned_slots and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.namespace_stats().pinned_slots == 0
    check_invariants(server.pool)


def test_a_first_frame_that_is_no_attach_is_refused_and_the_connection_closed(
    server: ServerThread, client: Client
) -> None:
    fs = FramedSession(framed_path(server))
    resp = fs.send(lookup=pb.LookupRequest(namespace_id=client.namespace_id))
    assert resp.error.code == INVALID and "first message of a session must be attach" in (
        resp.error.message
    )
    assert fs.read() is None
    fs.close()


def test_undecodable_frames_get_invalid_argument_and_the_session_goes_on(
    server: ServerThread, client: Client
) -> None:
    client.store(keys(7))
    fs = attached(server, client)
    fs.send_raw(b"\xff" * 20)
    resp = fs.read()
    assert resp is not None and resp.seq == 0 and resp.error.code == INVALID
    assert "not a valid kvoffload.v1.SessionRequest" in resp.error.message
    ok = fs.send(
        lookup=pb.LookupRequest(
            namespace_id=client.namespace_id, queries=[pb.KeyList(keys=keys(7))]
        )
    )
    assert list(ok.lookup.hit_counts) == [1]
    fs.close()


def test_an_oversized_or_cut_frame_ends_that_connection_only(
    server: ServerThread, client: Client
) -> None:
    big = attached(server, client)
    big.send_raw(b"", length=(1 << 31))  # 2 GiB announced: refused before reading it
    assert big.read() is None
    big.close()
    attached(server, client).cancel()  # half a frame, then gone
    again = attached(server, client)  # the socket still serves
    assert (
        again.send(lookup=pb.LookupRequest(namespace_id=client.namespace_id)).WhichOneof("result")
        == "lookup"
    )
    again.close()
    check_invariants(server.pool)


def test_drain_ends_framed_sessions_and_removes_the_socket(
    server: ServerThread, client: Client
) -> None:
    fs = attached(server, client)
    started = time.monotonic()
    server.drain(grace=0.5)  # the open session holds the drain for its grace, no longer
    assert time.monotonic() - started < 5
    assert fs.read() is None
    assert not framed_path(server).exists()
    fs.close()


def test_connections_served_at_once_race_on_shared_keys_and_leave_the_index_whole(
    server: ServerThread, client: Client
) -> None:
    """Each framed connection has its own thread in the sidecar: four connections store, pin
    and release overlapping keys at the same time (pipelined bursts included). Every answer
    matches its request, no slot is pinned after the releases, the index invariants hold, and
    the open-session count returns to zero when the connections close."""
    import random
    import threading

    ns = client.namespace_id
    errors: list[str] = []
    sessions = [attached(server, client) for _ in range(4)]
    assert server.sidecar.servicer.open_sessions == 4

    def work(fs: FramedSession, seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                ks = keys(*rng.sample(range(40), rng.randint(1, 12)))
                res = fs.send(reserve_store=pb.ReserveStoreRequest(namespace_id=ns, keys=ks))
                store = res.reserve_store
                if res.WhichOneof("result") != "reserve_store":
                    errors.append(f"reserve_store: {res.error.message}")
                    continue
                if store.store_id:
                    fs.send(
                        commit_store=pb.CommitStoreRequest(
                            namespace_id=ns, store_id=store.store_id, rank=0
                        )
                    )
                burst = [
                    pb.SessionRequest(
                        seq=fs._seq + 1 + i,
                        reserve_load=pb.ReserveLoadRequest(
                            namespace_id=ns, keys=keys(*rng.sample(range(40), 4))
                        ),
                    )
                    for i in range(3)
                ]
                fs.sock.sendall(
                    b"".join(
                        len(b).to_bytes(4, "little") + b
                        for b in (r.SerializeToString() for r in burst)
                    )
                )
                pins = []
                for r in burst:
                    answer = fs.read()
                    assert answer is not None
                    if answer.seq != r.seq:
                        errors.append(f"answer {answer.seq} for request {r.seq}")
                    if answer.reserve_load.pin_id:
                        pins.append(answer.reserve_load.pin_id)
                fs._seq += len(burst)
                if pins:
                    rel = fs.send(release=pb.ReleaseRequest(namespace_id=ns, pin_ids=pins))
                    if rel.WhichOneof("result") != "release":
                        errors.append(f"release: {rel.error.message}")
        except Exception as e:  # noqa: BLE001 - reported below, with the thread's seed
            errors.append(f"connection {seed}: {e!r}")

    threads = [threading.Thread(target=work, args=(fs, i)) for i, fs in enumerate(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    assert not errors, errors[:5]
    assert client.namespace_stats().pinned_slots == 0
    check_invariants(server.pool)
    for fs in sessions:
        fs.close()
    deadline = time.monotonic() + 10
    while server.sidecar.servicer.open_sessions and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.sidecar.servicer.open_sessions == 0


def test_register_names_the_presence_map_and_the_flag_turns_it_off(tmp_path: Path) -> None:
    """`pool.sock.presence` beside the socket, readable by any uid of the pod (0644), named at
    registration; `--presence-map false`: no file and no name (connectors ask every time)."""
    for on in (True, False):
        (tmp_path / str(on)).mkdir()
        with (
            socket_dir() as sock_dir,
            ServerThread(server_config(tmp_path / str(on), sock_dir, presence_map=on)) as srv,
            Client(srv.target) as c,
        ):
            wait_ready(c)
            reg = c.stub.Register(
                pb.RegisterRequest(
                    spec=spec(), num_ranks=1, slot_bytes_per_rank=64 << 10, client_name="t"
                )
            )
            path = srv.config.socket.with_name("pool.sock.presence")
            assert reg.presence_map == ("pool.sock.presence" if on else "")
            assert path.exists() is on
            if on:
                assert stat.S_IMODE(path.stat().st_mode) == 0o600  # private by default
        assert not path.exists()  # removed when the sidecar stops


def test_a_reported_presence_miss_counts_as_a_miss_though_its_keys_were_stored_since(
    server: ServerThread, client: Client
) -> None:
    """The connector reports presence-map misses seconds after answering them; an eager store
    may have committed those keys meanwhile. The report counts what the request saw (a miss)
    and leaves the blocks alone; a plain lookup of the same keys still hits."""
    client.store(keys(1, 2, 3))
    fs = attached(server, client)
    ns = client.namespace_id
    before = client.namespace_stats()
    report = fs.send(
        lookup=pb.LookupRequest(
            namespace_id=ns, queries=[pb.KeyList(keys=keys(1, 2, 3))], report_misses=True
        )
    )
    assert list(report.lookup.hit_counts) == [0]
    after = client.namespace_stats()
    assert after.hit_blocks == before.hit_blocks
    assert after.lookups == before.lookups + 1
    assert after.queried_blocks == before.queried_blocks + 3
    assert after.miss_blocks == before.miss_blocks + 1
    plain = fs.send(lookup=pb.LookupRequest(namespace_id=ns, queries=[pb.KeyList(keys=keys(1, 2))]))
    assert list(plain.lookup.hit_counts) == [2]
    assert client.namespace_stats().hit_blocks == before.hit_blocks + 2
    fs.close()
    check_invariants(server.pool)
