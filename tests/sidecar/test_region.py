"""The shared-memory pool file: exact size, pre-fault, sharing with another process."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
import textwrap
import threading

import pytest
from kvoffload_sidecar import region as region_mod
from kvoffload_sidecar.host import filesystem_type
from kvoffload_sidecar.region import PrefaultGate, Region

MiB = 1 << 20


def on_tmpfs(path) -> bool:
    return filesystem_type(path) == "tmpfs"


def test_file_is_exactly_the_pool_size(make_pool):
    size = 3 * MiB + 12345  # not even page aligned
    pool = make_pool(pool_size=size)
    assert pool.path.name == "pool-0.shm"
    assert os.stat(pool.path).st_size == size
    assert pool.wait_ready(10)
    assert pool.stats().prefaulted_bytes == size
    assert os.stat(pool.path).st_size == size  # the pre-fault never grows the file


def test_prefault_allocates_every_page(make_pool, pool_dir):
    if not on_tmpfs(pool_dir):
        pytest.skip("page accounting needs tmpfs")
    pool = make_pool(pool_size=8 * MiB)
    assert pool.wait_ready(10)
    assert os.stat(pool.path).st_blocks * 512 >= 8 * MiB


def test_strided_fallback_for_kernels_without_populate_write(make_pool, pool_dir, monkeypatch):
    if not on_tmpfs(pool_dir):
        pytest.skip("page accounting needs tmpfs")
    monkeypatch.setattr(Region, "_populate_ok", False)
    pool = make_pool(pool_size=4 * MiB)
    assert pool.wait_ready(10)
    assert os.stat(pool.path).st_blocks * 512 >= 4 * MiB


def test_no_prefault_mode_leaves_the_file_sparse(make_pool, pool_dir):
    pool = make_pool(pool_size=64 * MiB, prefault=False)
    assert pool.stats().pool_ready  # every slot is ready at once (bench/test mode)
    if on_tmpfs(pool_dir):  # only the index's header page is written
        assert os.stat(pool.path).st_blocks * 512 <= 16 << 10


@pytest.mark.process
def test_a_second_process_sees_the_pools_bytes(make_pool, small_spec):
    pool = make_pool(pool_size=8 * MiB)
    reg = pool.register(small_spec(tp_size=2), 2, 64 << 10, "rank-writer")
    r1 = reg.regions[1]
    where = r1.offset + 2 * r1.slot_bytes  # slot 2 of rank 1
    pool.region.buffer[where : where + 5] = b"hello"
    reader = textwrap.dedent(
        """
        import mmap, sys
        path, where = sys.argv[1], int(sys.argv[2])
        with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
            sys.stdout.write(mm[where:where + 5].decode())
            mm[where + 100:where + 105] = b"world"
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", reader, r1.path, str(where)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout == "hello"
    assert pool.region.buffer[where + 100 : where + 105] == b"world"  # MAP_SHARED both ways


def test_a_left_behind_file_is_reused_in_place_and_close_keeps_it(make_pool, pool_dir):
    stale = pool_dir / "pool-0.shm"
    stale.write_bytes(b"junk" * 1000)
    inode = stale.stat().st_ino
    pool = make_pool(pool_size=2 * MiB)
    assert pool.region.reused
    assert os.stat(pool.path).st_ino == inode  # vLLM may still map it: never a second file
    assert os.stat(pool.path).st_size == 2 * MiB
    assert stat.S_IMODE(os.stat(pool.path).st_mode) == 0o600  # private by default (filemode)
    pool.close()
    assert stale.stat().st_ino == inode  # kept: the pod's next sidecar adopts it
    pool.close(remove=True)
    assert not stale.exists()


def test_a_fresh_pool_is_not_marked_reused(make_pool, pool_dir):
    pool = make_pool(pool_size=2 * MiB)
    assert not pool.region.reused
    assert pool.region.buffer[:4] == b"\x00" * 4


def test_a_pool_file_that_cannot_be_reused_is_replaced(make_pool, pool_dir, caplog):
    (pool_dir / "elsewhere").write_bytes(b"x")
    (pool_dir / "pool-0.shm").symlink_to(pool_dir / "elsewhere")
    with caplog.at_level(logging.WARNING, logger="kvoffload_sidecar.region"):
        pool = make_pool(pool_size=2 * MiB)
    assert not pool.region.reused and not pool.path.is_symlink()
    assert (pool_dir / "elsewhere").read_bytes() == b"x"
    assert "cannot reuse the pool file" in caplog.text


def test_prefault_progress_line(make_pool, monkeypatch, caplog):
    monkeypatch.setattr(region_mod, "_PROGRESS_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO, logger="kvoffload_sidecar.region"):
        pool = make_pool(pool_size=4 * MiB)
        assert pool.wait_ready(10)
        pool.close()
    text = caplog.text
    assert "pool pre-fault:" in text and "GB/s" in text and "ETA" in text
    assert "pool pre-fault done" in text


def test_priority_ranges_advance_together(pool_dir):
    gate = PrefaultGate()
    lock = threading.Lock()
    region = Region(pool_dir, 8 * MiB, lock=lock, chunk_bytes=1 * MiB, gate=gate)
    region.open()
    try:
        with lock:
            region.set_priority([(0, 2 * MiB), (4 * MiB, 2 * MiB)])
        region.start_prefault()
        gate.step(1)
        with lock:
            assert (region.ready_prefix(0, 2 * MiB), region.ready_prefix(4 * MiB, 2 * MiB)) == (
                1 * MiB,
                0,
            )
        gate.step(1)  # the lagging range goes next, not file order
        with lock:
            assert region.ready_prefix(4 * MiB, 2 * MiB) == 1 * MiB
            assert region.ready_prefix(1 * MiB, 1 * MiB) == 0
        gate.step(2)  # both priority ranges done
        gate.step(1)  # then the rest in file order: chunk 2
        with lock:
            assert region.ready_prefix(0, 8 * MiB) == 3 * MiB
            assert region.prefaulted_bytes == 5 * MiB and not region.done
        gate.close()
        region._thread.join(10)  # type: ignore[union-attr]
        with lock:
            assert region.done and region.ready_prefix(0, 8 * MiB) == 8 * MiB
    finally:
        region.close()


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"size": 0}, ValueError, "positive number of bytes"),
        ({"size": 3 * MiB, "hugepages": True}, ValueError, "multiple of 2 MiB"),
        ({"size": 4 * MiB, "chunk_bytes": 1000}, ValueError, "multiple of the page size"),
        ({"size": 4 * MiB, "numa_node": -1}, ValueError, "numa node"),
    ],
)
def test_bad_region_settings(pool_dir, kwargs, error, message):
    with pytest.raises(error, match=message):
        Region(pool_dir, lock=threading.Lock(), **kwargs)


def test_hugepages_need_a_hugetlbfs_dir(pool_dir):
    if filesystem_type(pool_dir) == "hugetlbfs":
        pytest.skip("pool_dir is hugetlbfs here")
    region = Region(pool_dir, 4 * MiB, lock=threading.Lock(), hugepages=True)
    with pytest.raises(ValueError, match="not hugetlbfs"):
        region.open()


def test_missing_numa_node_is_refused_and_node_0_is_best_effort(make_pool):
    if not os.path.isdir("/sys/devices/system/node/node0"):
        pytest.skip("no NUMA sysfs")
    with pytest.raises(ValueError, match="does not exist"):
        make_pool(numa_node=4095, start=False)
    pool = make_pool(numa_node=0, pool_size=2 * MiB)
    assert pool.wait_ready(10)


def test_pool_dir_must_exist_and_be_writable(tmp_path):
    missing = Region(tmp_path / "nope", 2 * MiB, lock=threading.Lock())
    with pytest.raises(OSError, match="does not exist"):
        missing.open()
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(OSError, match="not writable"):
            Region(ro, 2 * MiB, lock=threading.Lock()).open()


def test_pool_bigger_than_the_filesystem_is_refused(pool_dir):
    st = os.statvfs(pool_dir)
    if not st.f_blocks:
        pytest.skip("filesystem reports no size")
    too_big = st.f_blocks * st.f_frsize + 64 * MiB
    with pytest.raises(OSError, match="bytes free"):
        Region(pool_dir, too_big, lock=threading.Lock()).open()
