"""A sidecar killed inside its pod (SIGKILL, OOM) comes back within the emptyDir's sizeLimit.

The pool dir is a real tmpfs mount sized for one pool and a small margin, as the injector sizes
the emptyDir: the dead instance's pool file is still there when the new one starts, and must be
removed (nobody serves the socket any more) before the new pool is sized.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import Client, kvoffload_command, short_dir, socket_dir, wait_ready, wait_serving

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

POOL_MIB = 16
MARGIN_MIB = 4  # far less than a second pool


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


def start(pool_dir: Path, sock: Path, log: Path) -> subprocess.Popen[bytes]:
    argv = [
        *kvoffload_command(),
        "sidecar",
        f"--pool-size={POOL_MIB}Mi",
        f"--pool-dir={pool_dir}",
        f"--socket={sock}",
    ]
    with open(log, "ab") as err:
        return subprocess.Popen(argv, stdout=err, stderr=err)


def test_sigkilled_sidecar_restarts_serving_within_the_size_limit(small_tmpfs: Path) -> None:
    with socket_dir() as run:
        sock, log = run / "pool.sock", run / "sidecar.log"
        proc = start(small_tmpfs, sock, log)
        try:
            for restart in range(4):  # the first start, then 3 restarts in a row
                began = time.monotonic()
                wait_serving(f"unix:{sock}", 10, alive=lambda p=proc: p.poll() is None)
                if restart:
                    assert time.monotonic() - began < 5, f"restart {restart} took too long"
                with Client(f"unix:{sock}") as client:
                    wait_ready(client)  # every page of the pool is now taken from the tmpfs
                    client.register()
                    assert client.lookup(b"\0" * 32) == [0]
                assert (small_tmpfs / "pool-0.shm").stat().st_blocks * 512 >= POOL_MIB << 20
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=10)
                assert sock.exists() and (small_tmpfs / "pool-0.shm").exists()  # left behind
                proc = start(small_tmpfs, sock, log)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- sidecar log ---\n{log.read_text()}") from None
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=15)
        assert "removed the stale pool file" in log.read_text()


def test_a_live_sidecars_pool_is_never_removed(small_tmpfs: Path) -> None:
    with socket_dir() as run:
        sock, log = run / "pool.sock", run / "sidecar.log"
        first = start(small_tmpfs, sock, log)
        try:
            wait_serving(f"unix:{sock}", 10, alive=lambda: first.poll() is None)
            inode = os.stat(small_tmpfs / "pool-0.shm").st_ino
            second = start(small_tmpfs, sock, log)
            assert second.wait(timeout=30) == 2  # refused: another process serves the socket
            assert os.stat(small_tmpfs / "pool-0.shm").st_ino == inode
            wait_serving(f"unix:{sock}", 2)
        finally:
            first.send_signal(signal.SIGTERM)
            assert first.wait(timeout=15) == 0, log.read_text()
