"""Who may open the sidecar's files and sockets, where its TCP listeners bind, and the pool's
mlock: a real sidecar process with the shipped defaults (0600), the pod's widening flag (0666),
and the Region's mlock on a tmpfs pool."""

from __future__ import annotations

import os
import stat
import tempfile
import threading
from pathlib import Path

import pytest
from kvoffload_sidecar import filemode
from kvoffload_sidecar.config import ConfigError, _parse_host_port, parse_config
from kvoffload_sidecar.host import can_lock
from kvoffload_sidecar.region import Region

from tests.sidecar.procs import sidecar_process, socket_dir


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def created(pool_dir: Path, sock_dir: Path) -> dict[str, int]:
    out = {p.name: mode(p) for p in pool_dir.iterdir() if not p.name.startswith(".")}
    out |= {p.name: mode(p) for p in sock_dir.iterdir() if p.suffix != ".log"}
    return out


@pytest.mark.process
@pytest.mark.parametrize(("args", "want"), [((), 0o600), (("--file-mode", "0666"), 0o666)])
def test_sockets_and_pool_file_are_private_unless_widened(
    tmp_path: Path, args: tuple[str, ...], want: int
) -> None:
    pool_dir = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="kvo-mode-"))
    try:
        with socket_dir() as sock_dir, sidecar_process(pool_dir, sock_dir, *args):
            modes = created(pool_dir, sock_dir)
        assert modes["pool-0.shm"] == want
        assert modes["pool.sock"] == want
        assert modes["pool.sock.session"] == want
        presence = [m for n, m in modes.items() if n.endswith(".presence")]
        assert presence == [(want & 0o444) | 0o600]  # read-only for the others let in
    finally:
        for p in pool_dir.iterdir():
            p.unlink()
        pool_dir.rmdir()


def test_file_mode_flag_refuses_execute_bits_and_a_private_owner() -> None:
    base = ["--pool-size", "16Mi", "--pool-dir", "/tmp", "--socket", "/tmp/s.sock"]
    assert parse_config([*base]).file_mode == 0o600
    assert parse_config([*base, "--file-mode", "0660"]).file_mode == 0o660
    for bad in ("0777", "0044", "rw"):
        with pytest.raises(ConfigError, match="file-mode"):
            parse_config([*base, "--file-mode", bad])


def test_a_bare_ipv6_pod_ip_is_bracketed() -> None:
    # the injector passes --listen=$(KVOFFLOAD_POD_IP):9400, and the pod IP may be IPv6
    assert _parse_host_port("fd00::1:9400") == "[fd00::1]:9400"
    assert _parse_host_port("10.1.2.3:9400") == "10.1.2.3:9400"
    assert _parse_host_port("[::]:9400") == "[::]:9400"


def test_the_pool_is_locked_in_memory_where_allowed(tmp_path: Path) -> None:
    pool_dir = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="kvo-lock-"))
    size = 64 << 20
    region = Region(pool_dir, size, lock=threading.Lock())
    try:
        region.open()
        region.start_prefault()
        region._thread.join(30)  # type: ignore[union-attr]
        allowed, why = can_lock(size)
        assert region.locked is allowed, why
        if allowed:  # the kernel's own account of it
            status = Path("/proc/self/status").read_text()
            locked_kb = int(
                next(line for line in status.splitlines() if line.startswith("VmLck")).split()[1]
            )
            assert locked_kb * 1024 >= size
    finally:
        region.close(remove=True)
        pool_dir.rmdir()
    filemode.set_mode(filemode.DEFAULT_MODE)
