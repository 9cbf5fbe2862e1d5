"""`kvoffload probe`, the native sidecar's startup probe, as the kubelet runs it: a process per
probe, its exit code read. It passes once the socket serves, or once the deadline has passed
since the first probe, so a sidecar that never comes up holds vLLM back for `deadline` at most."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import kvoffload_command, sidecar_process, socket_dir

pytestmark = [pytest.mark.process, pytest.mark.timeout(60)]


def probe(sock: Path, deadline: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*kvoffload_command(), "probe", "--socket", str(sock), "--deadline", str(deadline)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_absent_socket_fails_until_the_deadline_then_passes() -> None:
    with socket_dir() as run:
        sock = run / "pool.sock"
        first = probe(sock, 2)
        assert first.returncode == 1, first
        assert (run / ".kvoffload-probe-start").exists()
        assert probe(sock, 2).returncode == 1
        time.sleep(2.1)
        late = probe(sock, 2)
        assert late.returncode == 0, late
        assert late.stdout.startswith("sidecar not serving after 2s; letting vLLM start")


def test_live_socket_passes_at_once() -> None:
    with socket_dir() as run:
        sock = run / "pool.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(sock))
        listener.listen(4)
        try:
            done = probe(sock, 3600)
        finally:
            listener.close()
        assert done.returncode == 0, done
        assert done.stdout.strip() == f"sidecar serving on {sock}"


def test_a_real_sidecar_passes(tmp_path: Path) -> None:
    with socket_dir() as run, sidecar_process(tmp_path, run) as proc:
        assert probe(proc.socket, 3600).returncode == 0


def test_a_dead_socket_file_is_not_serving() -> None:
    with socket_dir() as run:
        sock = run / "pool.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(sock))
        listener.close()  # the file stays, nobody accepts
        assert probe(sock, 3600).returncode == 1


def test_probe_imports_no_grpc() -> None:
    code = (
        "import sys; from kvoffload_cli.main import main; rc = main(['probe', '--socket', "
        "'/nonexistent/dir/s.sock', '--deadline', '0']); "
        "bad = [m for m in ('grpc', 'google.protobuf', 'numpy', 'prometheus_client') "
        "if m in sys.modules]; print(rc, bad)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.stdout.splitlines()[-1] == "0 []", done  # no marker dir: the container's age
