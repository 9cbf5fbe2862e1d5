"""Run a real `kvoffload sidecar` as a child process: `kvoffload demo` does; the benchmarks
and the tests start their sidecars with it too.

Bounded everywhere: start waits for the socket with a deadline, stop sends
SIGTERM then SIGKILL. The pool lives in a directory on /dev/shm when there is
one (a memory filesystem, as in the pod).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from kvoffload.v1 import pool_pb2, pool_pb2_grpc


def kvoffload_command() -> list[str]:
    script = Path(sys.executable).parent / "kvoffload"
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvoffload_cli.main"]


def memory_dir(prefix: str = "kvo-") -> Path:
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 15 s (a sidecar drains for at most its 5 s grace)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


class SidecarProcess:
    """`kvoffload sidecar --pool-size SIZE --pool-dir DIR --socket DIR/pool.sock`."""

    def __init__(
        self, pool_size: str = "256Mi", workdir: Path | None = None, log_path: Path | None = None
    ):
        self.pool_size = pool_size
        self.workdir = workdir or memory_dir()
        self._own_dir = workdir is None
        self.socket = str(self.workdir / "pool.sock")
        self.log_path = log_path or (self.workdir / "sidecar.log")
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> SidecarProcess:
        if os.path.exists(self.socket):
            os.unlink(self.socket)
        log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the child
        self.proc = subprocess.Popen(
            [
                *kvoffload_command(),
                "sidecar",
                "--pool-size",
                self.pool_size,
                "--pool-dir",
                str(self.workdir),
                "--socket",
                self.socket,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sidecar exited with {self.proc.returncode}: {self.log()}")
            if os.path.exists(self.socket) and self._answers():
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"sidecar did not start within {timeout_s} s: {self.log()}")

    def _answers(self) -> bool:
        try:
            with grpc.insecure_channel(f"unix://{self.socket}") as ch:
                pool_pb2_grpc.KVPoolStub(ch).Stats(pool_pb2.StatsRequest(), timeout=1.0)
            return True
        except grpc.RpcError:
            return False

    def stats(self) -> pool_pb2.StatsResponse:
        with grpc.insecure_channel(f"unix://{self.socket}") as ch:
            return pool_pb2_grpc.KVPoolStub(ch).Stats(pool_pb2.StatsRequest(), timeout=5.0)

    def kill(self) -> None:
        """SIGKILL: the sidecar vanishes without a goodbye (the failure under test)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> SidecarProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
