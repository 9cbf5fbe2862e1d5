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
    server.pool.check_invariants()


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
    server.pool.check_invariants()


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
