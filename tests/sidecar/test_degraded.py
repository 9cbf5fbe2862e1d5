"""`--on-pool-error degrade`: a sidecar that cannot build its pool still starts and says why.

Each case is a real `kvoffload sidecar` process: health SERVING (so the pod's probes pass),
Stats with the reason (Unix socket and --listen), the Prometheus gauge, one log line, Register
refused with FAILED_PRECONDITION (a connector then serves without the pool), SIGTERM exits 0.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from procs import (
    Client,
    health_status,
    kvoffload_command,
    sidecar_process,
    socket_dir,
)

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]
LOG_LINE = "kvoffload sidecar: degraded, serving without a pool: "
SERVING = 1


def _metrics(log: str) -> str:
    port = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", log)
    assert port, log
    with urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/metrics", timeout=5) as r:
        return r.read().decode()


def _pool_bigger_than_free(pool_dir: Path) -> list[str]:
    st = os.statvfs(pool_dir)
    return ["--pool-size", str(st.f_bavail * st.f_frsize + (1 << 30))]


CASES = {
    # name: (extra args, how the pool dir is spoiled, reason code, words in the reason)
    "numa_node": (["--numa-node", "97"], None, "numa_node", "node 97 does not exist"),
    "no_hugepages": (["--hugepages"], None, "hugepages", "not hugetlbfs"),
    "pool_dir_missing": ([], "missing", "pool_dir", "does not exist"),
    "pool_too_big": ("too_big", None, "no_space", "does not fit"),
    "pool_creation_raises": ([], "pool_file_is_a_dir", "pool_error", "cannot create the pool"),
    "bad_setting": (["--eviction", "fifo"], None, "bad_setting", "'fifo' is not one of"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_degraded_sidecar_serves_health_and_stats_and_refuses_register(
    tmp_path: Path, case: str
) -> None:
    extra, spoil, code, words = CASES[case]
    pool_dir = tmp_path / "pool"
    pool_dir.mkdir()
    if spoil == "missing":
        pool_dir.rmdir()
    elif spoil == "pool_file_is_a_dir":
        (pool_dir / "pool-0.shm").mkdir()  # neither removable as a file nor creatable
    if extra == "too_big":
        extra = _pool_bigger_than_free(pool_dir)
    with (
        socket_dir() as sock_dir,
        sidecar_process(
            pool_dir,
            sock_dir,
            "--on-pool-error",
            "degrade",
            "--metrics-listen",
            "127.0.0.1:0",
            "--listen",
            "127.0.0.1:0",
            *extra,
            ready_timeout=15,
        ) as proc,
        Client(proc.target) as client,
    ):
        stats = client.stats()
        assert words in stats.degraded_reason, stats
        assert stats.pool_bytes == 0 and not stats.namespaces
        assert json.loads(stats.connector_status) == []
        with pytest.raises(grpc.RpcError) as refused:
            client.register()
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert words in refused.value.details()
        log = proc.stderr()
        assert log.count(LOG_LINE) == 1, log
        retries = code in ("no_space", "no_memory", "pool_dir", "pool_error")  # can go away
        assert ("retrying to build the pool every 5s" in log) == retries, log
        assert LOG_LINE + stats.degraded_reason in log
        assert f'kvoffload_pool_degraded{{reason="{code}"}} 1.0' in _metrics(log)
        shown = subprocess.run(
            [*kvoffload_command(), "stats", "--socket", str(proc.socket)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert shown.returncode == 0, shown.stderr
        first = shown.stdout.splitlines()[0]
        assert first == f"pool: degraded, serving without a pool: {stats.degraded_reason}"
        began = time.monotonic()
        assert proc.terminate() == 0
        assert time.monotonic() - began < 5


def test_healthy_sidecar_exports_degraded_0(tmp_path: Path) -> None:
    with (
        socket_dir() as sock_dir,
        sidecar_process(tmp_path, sock_dir, "--metrics-listen", "127.0.0.1:0") as proc,
        Client(proc.target) as client,
    ):
        assert client.stats().degraded_reason == ""
        assert 'kvoffload_pool_degraded{reason=""} 0.0' in _metrics(proc.stderr())
        assert LOG_LINE not in proc.stderr()


def test_degraded_via_env_and_listen_serves_health_over_tcp(tmp_path: Path) -> None:
    with socket_dir() as sock_dir:
        probe = __import__("socket").socket()
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        env = {"KVOFFLOAD_ON_POOL_ERROR": "degrade", "KVOFFLOAD_NUMA_NODE": "97"}
        with sidecar_process(
            tmp_path, sock_dir, "--listen", f"127.0.0.1:{port}", env=env, ready_timeout=15
        ) as proc:
            assert health_status(f"127.0.0.1:{port}") == SERVING
            with Client(f"127.0.0.1:{port}") as tcp:
                assert "node 97" in tcp.stats().degraded_reason
            assert proc.terminate() == 0


def test_without_degrade_a_missing_numa_node_still_exits_2(tmp_path: Path) -> None:
    with socket_dir() as sock_dir:
        done = subprocess.run(
            [
                *kvoffload_command(),
                "sidecar",
                "--pool-size=16Mi",
                f"--pool-dir={tmp_path}",
                f"--socket={sock_dir / 's.sock'}",
                "--numa-node=97",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            env={k: v for k, v in os.environ.items() if k != "KVOFFLOAD_ON_POOL_ERROR"},
        )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "node 97 does not exist" in done.stderr


@pytest.mark.parametrize("where", ["socket_dir_missing", "socket_served_by_another"])
def test_degraded_without_a_socket_stays_alive_until_sigterm(tmp_path: Path, where: str) -> None:
    with socket_dir() as sock_dir:
        if where == "socket_dir_missing":
            sock = sock_dir / "absent" / "s.sock"
            holder = None
        else:
            import socket

            sock = sock_dir / "s.sock"
            holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            holder.bind(str(sock))
            holder.listen(4)
        log = sock_dir / "sidecar.log"
        argv = [
            *kvoffload_command(),
            "sidecar",
            "--pool-size=16Mi",
            f"--pool-dir={tmp_path}",
            f"--socket={sock}",
            "--on-pool-error=degrade",
        ]
        with open(log, "wb") as err:
            proc = subprocess.Popen(argv, stdout=err, stderr=err)
        try:
            time.sleep(3)
            assert proc.poll() is None, log.read_text()
            text = log.read_text()
            assert text.count(LOG_LINE) == 1, text
            assert "kvoffload sidecar: degraded and " in text
            if holder is not None:
                assert sock.exists()  # never taken over
            began = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0
            assert time.monotonic() - began < 5
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if holder is not None:
                holder.close()


def test_a_listen_port_taken_degrades_instead_of_crashing(tmp_path: Path) -> None:
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        with (
            socket_dir() as sock_dir,
            sidecar_process(
                tmp_path,
                sock_dir,
                "--on-pool-error=degrade",
                f"--listen=127.0.0.1:{port}",
                ready_timeout=15,
            ) as proc,
            Client(proc.target) as client,
        ):
            assert "cannot serve the pool" in client.stats().degraded_reason
            # the pool was closed; its file stays for the next start to adopt
            assert (tmp_path / "pool-0.shm").exists()
            assert proc.terminate() == 0
    finally:
        taken.close()


@pytest.mark.parametrize("which", ["grpc", "framed"])
def test_degrade_mode_replaces_a_plain_file_at_its_socket_path(tmp_path: Path, which: str) -> None:
    """In a pod the run dir is the sidecar's own: a plain file left at a socket path (a script,
    a bad restart) must not leave the sidecar without its socket for the pod's whole life."""
    with socket_dir() as sock_dir:
        sock = sock_dir / "pool.sock"
        squatter = sock if which == "grpc" else sock.with_name("pool.sock.session")
        squatter.write_text("not a socket\n")
        with (
            sidecar_process(tmp_path, sock_dir, "--on-pool-error", "degrade") as proc,
            Client(proc.target) as client,
        ):
            assert client.stats().degraded_reason == ""
            client.register()
            assert "not a socket" in proc.stderr()
            assert squatter.is_socket()


def test_exit_mode_still_refuses_a_plain_file_at_its_socket_path(tmp_path: Path) -> None:
    with socket_dir() as sock_dir:
        (sock_dir / "pool.sock").write_text("someone's file\n")
        run = subprocess.run(
            [*kvoffload_command(), "sidecar", "--pool-size", "16Mi", "--pool-dir", str(tmp_path),
             "--socket", str(sock_dir / "pool.sock")],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert run.returncode == 2, run.stderr
        assert "exists and is not a socket" in run.stderr
        assert (sock_dir / "pool.sock").read_text() == "someone's file\n"
