"""The sidecar refuses a pool its container's memory limit cannot hold (memory_room.py): the
cgroup files it reads (v1, v2, a container's own root), and a real sidecar in a real memory
cgroup that serves degraded instead of being OOM-killed, then builds its pool once the limit
is raised in place."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from kvoffload_sidecar.memory_room import (
    SELF_RESERVE_BYTES,
    MemoryRoom,
    memory_room,
    pool_shortfall,
)
from procs import Client, sidecar_process, socket_dir

MIB = 1 << 20


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v1_reads_the_hierarchical_limit(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    _write(proc, "5:cpu:/\n4:memory:/pod/sidecar\n0::/\n")
    d = tmp_path / "sys" / "memory" / "pod" / "sidecar"
    _write(d / "memory.limit_in_bytes", "9223372036854771712\n")  # its own: none
    _write(
        d / "memory.stat",
        # the pod's limit; 40 MiB of inactive file cache the kernel would reclaim
        "cache 1\nhierarchical_memory_limit 1073741824\ntotal_inactive_file 41943040\n",
    )
    _write(d / "memory.usage_in_bytes", "104857600\n")
    assert memory_room(proc, tmp_path / "sys") == MemoryRoom(1 << 30, 60 * MIB)
    _write(d / "memory.stat", "hierarchical_memory_limit 9223372036854771712\n")
    assert memory_room(proc, tmp_path / "sys") is None  # unlimited: nothing to refuse


def test_cgroup_v2_takes_the_lowest_limit_up_the_tree_and_a_containers_root(
    tmp_path: Path,
) -> None:
    proc = tmp_path / "cgroup"
    _write(proc, "0::/kubepods/pod1/sidecar\n")
    root = tmp_path / "sys"
    _write(root / "kubepods" / "memory.max", "max\n")
    _write(root / "kubepods" / "pod1" / "memory.max", "536870912\n")
    _write(root / "kubepods" / "pod1" / "sidecar" / "memory.max", "max\n")
    _write(root / "kubepods" / "pod1" / "sidecar" / "memory.current", "3145728\n")
    _write(root / "kubepods" / "pod1" / "sidecar" / "memory.stat", "inactive_file 2097152\n")
    assert memory_room(proc, root) == MemoryRoom(512 * MIB, MIB)
    # inside a container (cgroup namespace): "0::/" and the container's files at the root
    own = tmp_path / "own"
    _write(own / "memory.max", "268435456\n")
    _write(own / "memory.current", "2097152\n")
    _write(proc, "0::/\n")
    assert memory_room(proc, own) == MemoryRoom(256 * MIB, 2 * MIB)
    assert memory_room(tmp_path / "missing", own) is None


def test_the_shortfall_counts_the_pool_its_index_and_the_process_not_resident_pages() -> None:
    pool = 1 << 30
    need = pool + pool // 256 + SELF_RESERVE_BYTES
    assert pool_shortfall(pool, 0, None) is None
    assert pool_shortfall(pool, 0, MemoryRoom(need + 60 * MIB, 60 * MIB)) is None
    reason = pool_shortfall(pool, 0, MemoryRoom(need + 59 * MIB, 60 * MIB))
    assert reason is not None and "does not fit the sidecar container's memory limit" in reason
    assert "spec.sidecar.resources.limits.memory" in reason
    # a restart that adopts a resident file needs room only for the rest
    assert pool_shortfall(pool, pool, MemoryRoom(pool + 100 * MIB, pool)) is None


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[Path]:
    """A real cgroup v1 memory cgroup (skip where this box has none to make)."""
    root = Path("/sys/fs/cgroup/memory")
    if os.geteuid() != 0 or not (root / "cgroup.procs").exists():
        pytest.skip("needs root and a cgroup v1 memory hierarchy")
    d = root / f"kvo-test-{uuid.uuid4().hex[:8]}"
    try:
        d.mkdir()
        (d / "memory.limit_in_bytes").write_text(str(limit))
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup here: {exc}")
    try:
        yield d
    finally:
        with contextlib.suppress(OSError):
            (d / "memory.force_empty").write_text("0")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                d.rmdir()
                break
            except OSError:
                time.sleep(0.2)


@contextlib.contextmanager
def tmpfs(size: int) -> Iterator[Path]:
    d = Path(f"/tmp/kvo-tmpfs-{uuid.uuid4().hex[:8]}")
    d.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0777", "tmpfs", str(d)], check=False
    )
    if r.returncode:
        d.rmdir()
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)
        d.rmdir()


@pytest.mark.process
@pytest.mark.timeout(120)
def test_a_real_sidecar_over_its_memory_limit_serves_degraded_then_builds_when_raised() -> None:
    pool = 256 * MIB
    with (
        memory_cgroup(160 * MIB) as cg,
        tmpfs(pool + 64 * MIB) as pool_dir,
        socket_dir() as sock_dir,
        sidecar_process(
            pool_dir,
            sock_dir,
            "--on-pool-error",
            "degrade",
            "--pool-retry-interval",
            "0.5",
            pool_size=str(pool),
            ready_timeout=30,
            # the process joins the cgroup before it execs the sidecar, as a container's does
            wrap=["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$@"', "sh"],
        ) as proc,
        Client(proc.target) as client,
    ):
        stats = client.stats()
        assert "does not fit the sidecar container's memory limit" in stats.degraded_reason
        assert stats.pool_bytes == 0
        assert proc.proc.poll() is None  # alive: refused, not OOM-killed part-way
        assert int((cg / "memory.failcnt").read_text()) == 0  # never even reached the limit
        # the limit raised in place (an in-place pod resize): the next attempt builds the pool
        (cg / "memory.limit_in_bytes").write_text(str(pool + 256 * MIB))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _pool_bytes(proc.target) == 0:
            time.sleep(0.2)  # the degraded server hands its socket to the pool's: a gap
        with Client(proc.target) as fresh:
            stats = fresh.stats()
            assert stats.pool_bytes == pool and not stats.degraded_reason, stats
            fresh.register()  # a connector's registration is taken now
        assert proc.proc.poll() is None


def _pool_bytes(target: str) -> int:
    try:
        with Client(target) as c:
            return int(c.stats().pool_bytes)
    except grpc.RpcError:
        return 0
