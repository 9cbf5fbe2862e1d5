"""A sidecar killed inside its pod (SIGKILL, OOM) comes back within the emptyDir's sizeLimit.

The pool dir is a real tmpfs mount sized for one pool and a small margin, as the injector sizes
the emptyDir. vLLM keeps running while the sidecar restarts and keeps the old pool file mapped
(here: a separate process of another uid, as the vLLM container may be), so deleting that file
frees nothing: the new sidecar must reuse the same file (same inode) and serve at once, not
degraded. Stores wait out a short quarantine after such a restart (late copies of the dead
instance's clients); a sidecar degraded for lack of room retries and serves once room is back.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from kvoffload.v1 import pool_pb2 as pb
from procs import (
    Client,
    keys,
    kvoffload_command,
    short_dir,
    socket_dir,
    stop_process,
    wait_ready,
    wait_serving,
)

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

MiB = 1 << 20
POOL_MIB = 16
MARGIN_MIB = 4  # far less than a second pool
VLLM_PYTHON = Path(sys.executable)  # this checkout's venv (on /usr/bin/python3: other uids run it)
REUSE_LINE = "adopted the pool file "
NEW, NO_SPACE = pb.STORE_DECISION_NEW, pb.STORE_DECISION_NO_SPACE

# What the connector's workers do with the pool file: map all of it shared, write a few pages,
# keep the mapping while the sidecar comes and goes. Runs until its stdin closes.
MAPPER = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
mm = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED)
os.close(fd)
for page in range(0, len(mm), len(mm) // 8):
    mm[page] = 1
print("mapped", len(mm), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def small_tmpfs() -> Iterator[Path]:
    """A tmpfs of pool + margin, mode 0777; skipped where mounting is not permitted."""
    point = short_dir("kvo-tmpfs-")
    size = f"size={(POOL_MIB + MARGIN_MIB)}m,mode=0777"
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", size, "tmpfs", str(point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        point.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)
        with contextlib.suppress(OSError):
            point.rmdir()


def start(pool_dir: Path, sock: Path, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    argv = [
        *kvoffload_command(),
        "sidecar",
        f"--pool-size={POOL_MIB}Mi",
        f"--pool-dir={pool_dir}",
        f"--socket={sock}",
        "--on-pool-error=degrade",  # what the injector sets
        "--file-mode=0666",  # what the injector sets too: vLLM runs as another uid of the pod
        *extra,
    ]
    with open(log, "ab") as err:
        return subprocess.Popen(argv, stdout=err, stderr=err)


@contextlib.contextmanager
def vllm_mapping(pool_file: Path) -> Iterator[subprocess.Popen[str]]:
    """Another uid's process mapping the whole pool file until the block ends."""
    if shutil.which("setpriv") is None or not VLLM_PYTHON.exists():
        pytest.skip("setpriv or the venv's python is missing")
    proc = subprocess.Popen(
        ["setpriv", "--reuid=1000", "--regid=0", "--clear-groups", "--"]
        + [str(VLLM_PYTHON), "-c", MAPPER, str(pool_file)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("mapped"), f"{line!r} {proc.stderr.read() if proc.stderr else ''}"
        yield proc
    finally:
        with contextlib.suppress(OSError):
            proc.stdin.close()  # type: ignore[union-attr]
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def unpack_slots(packed: bytes) -> list[int]:
    """Slot numbers of a reservation's answer (uint32 LE)."""
    return list(struct.unpack(f"<{len(packed) // 4}I", packed))


def used_bytes(point: Path) -> int:
    """What `df` shows as used on the tmpfs."""
    st = os.statvfs(point)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def serves_a_pool(sock: Path) -> bool:
    with Client(f"unix:{sock}", timeout=1) as client:
        try:
            stats = client.stats()
        except grpc.RpcError:
            return False
    return bool(stats.pool_bytes) and not stats.degraded_reason


def test_sigkilled_sidecar_restarts_serving_while_vllm_maps_the_pool(small_tmpfs: Path) -> None:
    pool_file = small_tmpfs / "pool-0.shm"
    with socket_dir() as run:
        sock, log = run / "pool.sock", run / "sidecar.log"
        proc = start(small_tmpfs, sock, log)
        try:
            wait_serving(f"unix:{sock}", 10, alive=lambda: proc.poll() is None)
            with Client(f"unix:{sock}") as client:
                wait_ready(client)
            inode = pool_file.stat().st_ino
            with vllm_mapping(pool_file):
                for restart in range(1, 4):
                    proc.send_signal(signal.SIGKILL)
                    proc.wait(timeout=10)
                    assert sock.exists() and pool_file.exists()  # left behind
                    began = time.monotonic()
                    proc = start(small_tmpfs, sock, log)
                    wait_serving(f"unix:{sock}", 10, alive=lambda p=proc: p.poll() is None)
                    with Client(f"unix:{sock}") as client:
                        stats = wait_ready(client)
                        assert stats.degraded_reason == "", stats.degraded_reason
                        client.register()
                        assert client.lookup(keys(0)) == [0]  # nothing was ever stored
                        assert stats.adoption.outcome == "adopted", stats.adoption
                        assert stats.adoption.boots == restart + 1
                    took = time.monotonic() - began
                    assert took < 5, f"restart {restart} took {took:.1f}s"
                    assert pool_file.stat().st_ino == inode, "the pool file was replaced"
                    used = used_bytes(small_tmpfs)
                    assert POOL_MIB * MiB <= used < (POOL_MIB + 1) * MiB, (restart, used)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- sidecar log ---\n{log.read_text()}") from None
        finally:
            stop_process(proc)
        assert log.read_text().count(REUSE_LINE) == 3


def test_slots_reserved_at_death_stay_out_while_their_engine_lives(small_tmpfs: Path) -> None:
    """A store the dead sidecar had reserved may still be copying into its slot: the adopter
    withholds that slot for as long as the engine that reserved it lives (past the grace and
    the hold), and frees it once the engine's workers exited; every other free slot takes
    stores at once."""
    grace = 2.0
    with socket_dir() as run:
        sock, log = run / "pool.sock", run / "sidecar.log"
        proc = start(
            small_tmpfs, sock, log, f"--detach-grace={grace:g}", f"--reserved-hold={grace:g}"
        )
        try:
            wait_serving(f"unix:{sock}", 10, alive=lambda: proc.poll() is None)
            with Client(f"unix:{sock}") as client:
                wait_ready(client)
                client.register()
                first = client.reserve_store(keys(1))  # never committed: in flight at death
                assert list(first.decisions) == [NEW]
                (in_flight,) = unpack_slots(first.slots)
                slot_count = client.namespace_stats().slot_count
                owner, client.locks = client.locks, []  # its engine's workers live on
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            proc = start(
                small_tmpfs, sock, log, f"--detach-grace={grace:g}", f"--reserved-hold={grace:g}"
            )
            wait_serving(f"unix:{sock}", 10, alive=lambda: proc.poll() is None)
            with Client(f"unix:{sock}") as client:
                stats = wait_ready(client)
                assert stats.adoption.outcome == "adopted", stats.adoption
                assert dict(stats.adoption.discarded_blocks) == {"reserved": 1}
                client.register()
                every = keys(*range(100, 100 + slot_count))
                held = client.reserve_store(every)
                got = unpack_slots(held.slots)
                assert list(held.decisions) == [NEW] * (slot_count - 1) + [NO_SPACE]
                assert in_flight not in got
                assert client.abort(held.store_id) == slot_count - 1
                time.sleep(2 * grace)  # past the grace, the hold and reaper ticks
                res = client.reserve_store(every)
                assert in_flight not in unpack_slots(res.slots)
                client.abort(res.store_id)
                for lock in owner:  # the engine exited: the kernel drops its locks
                    lock.release()
                end = time.monotonic() + 10
                while len(unpack_slots((res := client.reserve_store(every)).slots)) < slot_count:
                    assert time.monotonic() < end, "the slot never came back"
                    client.abort(res.store_id)
                    time.sleep(0.1)
                assert in_flight in unpack_slots(res.slots)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- sidecar log ---\n{log.read_text()}") from None
        finally:
            stop_process(proc)
        text = log.read_text()
    assert text.count(REUSE_LINE) == 1, text


def test_degraded_for_no_space_retries_and_serves_once_room_is_back(small_tmpfs: Path) -> None:
    interval = 1.0
    blocker = small_tmpfs / "blocker"
    blocker.write_bytes(b"\1" * (8 * MiB))  # 12 MiB left: the 16 MiB pool does not fit
    port = free_port()
    with socket_dir() as run:
        sock, log = run / "pool.sock", run / "sidecar.log"
        proc = start(
            small_tmpfs,
            sock,
            log,
            f"--pool-retry-interval={interval:g}",
            f"--metrics-listen=127.0.0.1:{port}",
        )
        try:
            wait_serving(f"unix:{sock}", 10, alive=lambda: proc.poll() is None)
            assert 'kvoffload_pool_degraded{reason="no_space"} 1.0' in metrics(port)
            with Client(f"unix:{sock}") as client:
                assert "does not fit" in client.stats().degraded_reason
                with pytest.raises(grpc.RpcError) as refused:
                    client.register()
                assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            time.sleep(2 * interval)  # a few failed retries while the blocker is there
            assert "pool built after" not in log.read_text()
            blocker.unlink()
            freed = time.monotonic()
            deadline = freed + 2 * interval + 3  # two intervals and the restart of the servers
            while time.monotonic() < deadline and not serves_a_pool(sock):
                time.sleep(0.1)
            took = time.monotonic() - freed
            assert took < 2 * interval + 3, f"not serving {took:.1f}s after room came back"
            wait_serving(f"unix:{sock}", 5)
            with Client(f"unix:{sock}") as client:
                assert client.register().namespace_id
                assert client.stats().degraded_reason == ""
            assert 'kvoffload_pool_degraded{reason=""} 0.0' in metrics(port)
            assert proc.poll() is None
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- sidecar log ---\n{log.read_text()}") from None
        finally:
            stop_process(proc)
        text = log.read_text()
    assert text.count("kvoffload sidecar: degraded, serving without a pool: ") == 1, text
    assert "; serving" in text and "pool built after " in text, text


def test_a_live_sidecars_pool_is_never_touched(small_tmpfs: Path) -> None:
    with socket_dir() as run:
        sock, log = run / "pool.sock", run / "sidecar.log"
        first = start(small_tmpfs, sock, log)
        try:
            wait_serving(f"unix:{sock}", 10, alive=lambda: first.poll() is None)
            inode = os.stat(small_tmpfs / "pool-0.shm").st_ino
            argv = [
                *kvoffload_command(),
                "sidecar",
                f"--pool-size={POOL_MIB}Mi",
                f"--pool-dir={small_tmpfs}",
                f"--socket={sock}",
            ]
            second = subprocess.run(argv, capture_output=True, timeout=30, check=False)
            assert second.returncode == 2  # refused: another process serves the socket
            assert os.stat(small_tmpfs / "pool-0.shm").st_ino == inode
            wait_serving(f"unix:{sock}", 2)
            with Client(f"unix:{sock}") as client:
                assert client.stats().degraded_reason == ""
        finally:
            first.send_signal(signal.SIGTERM)
            assert first.wait(timeout=15) == 0, log.read_text()
