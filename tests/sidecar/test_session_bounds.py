"""The framed server holds at most `--max-sessions` connections (each one is a thread): idle or
leaked connections beyond it are refused with one RESOURCE_EXHAUSTED frame, and the sidecar keeps
serving real clients."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from kvoffload.v1 import pool_pb2 as pb
from procs import Client, FramedSession, ServerThread, keys, server_config, socket_dir, wait_ready

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]
MAX_SESSIONS = 16
IDLE = 300
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    with (
        socket_dir() as sock_dir,
        ServerThread(server_config(tmp_path, sock_dir, max_sessions=MAX_SESSIONS)) as srv,
    ):
        yield srv


def framed_path(server: ServerThread) -> Path:
    return server.config.socket.with_name(server.config.socket.name + ".session")


def test_idle_connections_beyond_the_limit_are_refused_and_threads_stay_bounded(
    server: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    baseline = threading.active_count()
    idle: list[socket.socket] = []
    try:
        for _ in range(IDLE):
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(str(framed_path(server)))  # blocking: waits while the backlog is full
            conn.settimeout(10)
            idle.append(conn)
        deadline = time.monotonic() + 10
        while server.sidecar.frames.refused < IDLE - MAX_SESSIONS and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.sidecar.frames.refused == IDLE - MAX_SESSIONS
        assert threading.active_count() <= baseline + MAX_SESSIONS, threading.active_count()
        refused = FramedSession.__new__(FramedSession)
        refused.sock = idle[-1]  # a refused one: one error frame, then closed
        reply = refused.read()
        assert reply is not None and reply.WhichOneof("result") == "error", reply
        assert reply.error.code == EXHAUSTED
        assert reply.error.message == (
            f"refusing framed session: {MAX_SESSIONS} open (--max-sessions)"
        )
        assert refused.read() is None
        lines = [r.getMessage() for r in caplog.records if "refusing framed" in r.getMessage()]
        assert len(lines) == 1, lines  # once per burst
    finally:
        for conn in idle:
            conn.close()
    # the idle ones are gone: a real client is served again
    with Client(server.target) as client:
        wait_ready(client)
        client.register()
        deadline = time.monotonic() + 10
        while server.sidecar.servicer.open_sessions and time.monotonic() < deadline:
            time.sleep(0.05)
        fs = FramedSession(framed_path(server))
        try:
            attached = fs.send(attach=pb.AttachRequest(client_id=client.client_id))
            assert attached.WhichOneof("result") == "attach", attached
            looked = fs.send(
                lookup=pb.LookupRequest(
                    namespace_id=client.namespace_id, queries=[pb.KeyList(keys=keys(1))]
                )
            )
            assert list(looked.lookup.hit_counts) == [0]
        finally:
            fs.close()
    assert threading.active_count() <= baseline + 1
