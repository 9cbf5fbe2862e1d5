"""The sidecar as a real `kvoffload sidecar` subprocess: shutdown, dropped clients, warm restart."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvoffload.v1 import pool_pb2 as pb
from procs import (
    Client,
    Session,
    SidecarProc,
    keys,
    run_client,
    sidecar_process,
    socket_dir,
    start_client,
    wait_ready,
    wire_slots,
)

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with socket_dir() as path:
        yield path


@pytest.fixture
def sidecar(tmp_path: Path, sock_dir: Path) -> Iterator[SidecarProc]:
    with sidecar_process(tmp_path, sock_dir) as proc:
        yield proc


def _wait_for(cond, timeout: float = 10.0, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"{what} not met after {timeout}s"
        time.sleep(0.05)


def test_sigterm_drains_and_exits_zero(sidecar: SidecarProc) -> None:
    pool_file = sidecar.pool_dir / "pool-0.shm"
    assert pool_file.exists()
    statuses: list[int] = []
    watching = threading.Event()

    def watch() -> None:
        with grpc.insecure_channel(sidecar.target) as channel:
            try:
                for resp in health_pb2_grpc.HealthStub(channel).Watch(
                    health_pb2.HealthCheckRequest(service="kvoffload.v1.KVPool"), timeout=20
                ):
                    statuses.append(resp.status)
                    watching.set()
            except grpc.RpcError:
                pass  # the server went away: the stream ends

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    assert watching.wait(10)
    with Client(sidecar.target) as client:
        reg = client.register()
        client.store(keys(1, 2))
        session = Session(client)
        session.send(attach=pb.AttachRequest(client_id=reg.client_id))
        pin = session.send(
            reserve_load=pb.ReserveLoadRequest(namespace_id=reg.namespace_id, keys=keys(1, 2))
        )
        ns = reg.namespace_id
        in_flight = session.send(
            reserve_store=pb.ReserveStoreRequest(namespace_id=ns, keys=keys(5))
        )
        store_id = in_flight.reserve_store.store_id
        assert store_id
        start = time.monotonic()
        sidecar.proc.send_signal(signal.SIGTERM)
        _wait_for(lambda: NOT_SERVING in statuses, 5, "NOT_SERVING on the health watch")
        # While a store is in flight the open session still works, but new reservations are
        # refused; its commit ends the drain (the pool file stays for the next sidecar).
        refused = session.send(reserve_store=pb.ReserveStoreRequest(namespace_id=ns, keys=keys(3)))
        assert refused.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
        hit = session.send(
            lookup=pb.LookupRequest(namespace_id=ns, queries=[pb.KeyList(keys=keys(1, 2))])
        )
        assert list(hit.lookup.hit_counts) == [2]
        released = session.send(
            release=pb.ReleaseRequest(namespace_id=ns, pin_ids=[pin.reserve_load.pin_id])
        )
        assert released.release.released_slots == 2
        assert client.lookup(keys(1, 2)) == [2]  # unary reads too
        with pytest.raises(grpc.RpcError) as info:
            client.reserve_store(keys(4))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        commit = pb.CommitStoreRequest(
            namespace_id=ns,
            store_id=store_id,
            rank=0,
            sidecar_epoch=client.epoch,
            engine=client.engine,
        )
        assert session.send(commit_store=commit).commit_store.visible  # nothing left to wait for
        session.close()
        rc = sidecar.terminate(timeout=10)
    elapsed = time.monotonic() - start
    watcher.join(timeout=5)
    assert rc == 0, sidecar.stderr()
    assert elapsed < 3.0, f"drain took {elapsed:.1f}s (a health Watch must not hold it)"
    assert statuses[:1] == [SERVING]
    assert pool_file.exists()  # kept: the pod's next sidecar adopts it (an upgrade loses nothing)
    assert not sidecar.socket.exists()
    assert "draining" in sidecar.stderr()


def test_sigterm_with_a_lingering_session_exits_within_grace(sidecar: SidecarProc) -> None:
    with Client(sidecar.target) as client:
        reg = client.register()
        session = Session(client)
        session.send(attach=pb.AttachRequest(client_id=reg.client_id))
        start = time.monotonic()
        rc = sidecar.terminate(timeout=15)
        elapsed = time.monotonic() - start
        session.cancel()
    assert rc == 0, sidecar.stderr()
    assert elapsed < 5.0 + 3.0  # grace 5 s, then the session is cancelled


def test_connection_drop_releases_pins(sidecar: SidecarProc) -> None:
    pinner = start_client("pin", "--socket", str(sidecar.socket), "--n", "8")
    try:
        line = pinner.stdout.readline()  # type: ignore[union-attr]
        assert line, pinner.stderr.read()  # type: ignore[union-attr]
        pinned = json.loads(line)
        assert len(pinned["slots"]) == 8
        with Client(sidecar.target) as client:
            wait_ready(client)
            reg = client.register()
            ns = client.namespace_stats()
            assert ns.pinned_slots == 8
            assert ns.live_clients == 2
            slot_count = reg.regions[0].slot_count

            pinner.send_signal(signal.SIGKILL)  # no goodbye: the stream just drops
            pinner.wait(timeout=10)
            _wait_for(lambda: client.namespace_stats().pinned_slots == 0, what="pins released")
            assert client.namespace_stats().live_clients == 1
            assert client.lookup(keys(*range(8))) == [8]  # still committed, now evictable

            fill = client.reserve_store(keys(*range(1000, 1000 + slot_count)))
            assert set(fill.decisions) == {pb.STORE_DECISION_NEW}
            assert set(pinned["slots"]) <= set(
                wire_slots(fill.slots)
            )  # the formerly pinned slots were reused
            assert client.lookup(keys(*range(8))) == [0]
            assert client.namespace_stats().evicted_blocks == 8
            client.abort(fill.store_id)
    finally:
        if pinner.poll() is None:
            pinner.kill()
            pinner.wait(timeout=5)
        pinner.stdout.close()  # type: ignore[union-attr]
        pinner.stderr.close()  # type: ignore[union-attr]


def test_warm_restart_finds_committed_blocks(sidecar: SidecarProc) -> None:
    first = run_client("store", "--socket", str(sidecar.socket), "--n", "12")
    assert first["committed_blocks"] == 0
    assert first["hits"] == 12
    second = run_client("store", "--socket", str(sidecar.socket), "--n", "12")  # vLLM restarted
    assert second["namespace_id"] == first["namespace_id"]
    assert second["committed_blocks"] == 12
    assert second["hits"] == 12
    with Client(sidecar.target) as client:
        client.register()
        ns = client.namespace_stats()
        assert (ns.stored_blocks, ns.committed_slots) == (
            12,
            12,
        )  # the second run stored nothing new


def test_idle_client_without_session_is_reaped(tmp_path: Path, sock_dir: Path) -> None:
    with (
        sidecar_process(tmp_path, sock_dir, "--client-timeout", "0.4") as proc,
        Client(proc.target) as client,
    ):
        client.register()
        client.store(keys(1, 2))
        client.reserve_load(keys(1, 2))
        assert client.namespace_stats().pinned_slots == 2
        _wait_for(
            lambda: client.namespace_stats().pinned_slots == 0, what="client reaped, pins released"
        )
        ns = client.namespace_stats()
        assert (ns.live_clients, ns.committed_slots) == (0, 2)
        with pytest.raises(grpc.RpcError) as info:
            client.reserve_load(keys(1))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert "reaping idle client" in proc.stderr()


def test_stale_socket_file_is_replaced(tmp_path: Path, sock_dir: Path) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock_dir / "pool.sock"))
    stale.close()  # the file stays: what a SIGKILLed sidecar leaves behind
    with sidecar_process(tmp_path, sock_dir) as proc, Client(proc.target) as client:
        assert client.stats().pool_bytes == 16 << 20
        assert "removed stale socket" in proc.stderr()


def test_second_sidecar_on_a_live_socket_is_refused(sidecar: SidecarProc, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    import subprocess

    from procs import kvoffload_command

    done = subprocess.run(
        [
            *kvoffload_command(),
            "sidecar",
            "--pool-size",
            "4Mi",
            "--pool-dir",
            str(other),
            "--socket",
            str(sidecar.socket),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2
    assert "another process is serving" in done.stderr
    with Client(sidecar.target) as client:  # the first one is unharmed
        assert client.stats().pool_bytes == 16 << 20
