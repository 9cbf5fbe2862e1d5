"""The pool over a given sealed memfd (node mode's tenant memory): mapped, never resized or
unlinked, pre-faulted per range through the caller's allocator with slots handed out only
behind it, engine locks on the memfd's descriptions, and its index adopted by the next pool
over the same memory."""

from __future__ import annotations

import fcntl
import os
import struct
import threading
from collections.abc import Iterator

import pytest
from kvoffload_sidecar.engine_locks import engine_offset
from kvoffload_sidecar.keys import NamespaceSpec
from kvoffload_sidecar.memfd_region import FdBacking
from kvoffload_sidecar.pool import Pool, PoolSettings
from kvoffload_sidecar.region import PrefaultGate

MiB = 1 << 20
SIZE = 8 * MiB
SLOT = 1 * MiB
_FLOCK = struct.Struct("@hhqqi4x")
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
SEALS = fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL


def build_spec() -> NamespaceSpec:
    return NamespaceSpec(
        model="test-model",
        dtype="bfloat16",
        kv_layout="LBHNC/packed-kv",
        block_size=16,
        chunk_blocks=1,
        tp_size=1,
        hash_algo="sha256",
        key_size=8,
    )


def pack_keys(ints: list[int]) -> bytes:
    return b"".join(i.to_bytes(8, "big") for i in ints)


def sealed_memfd(size: int = SIZE, seals: int = SEALS) -> int:
    fd = os.memfd_create("kvoffload-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def settings(**overrides: object) -> PoolSettings:
    fields: dict[str, object] = dict(pool_size=SIZE, pool_dir=None, prefault_chunk_bytes=MiB)
    fields.update(overrides)
    return PoolSettings(**fields)  # type: ignore[arg-type]


class Engine:
    """A worker rank's lock on its own open file description of the memfd (as a pod holds it
    on the description memory.sock gave it)."""

    def __init__(self, memfd: int, pool: Pool, engine: int) -> None:
        self.fd = os.open(f"/proc/self/fd/{memfd}", os.O_RDWR | os.O_CLOEXEC)
        at = engine_offset(pool.lock_base, engine, 0)
        fcntl.fcntl(self.fd, _F_OFD_SETLK, _FLOCK.pack(fcntl.F_RDLCK, 0, at, 1, 0))

    def die(self) -> None:
        os.close(self.fd)


@pytest.fixture
def memfd() -> Iterator[int]:
    fd = sealed_memfd()
    try:
        yield fd
    finally:
        os.close(fd)


def start(memfd: int, **kwargs: object) -> Pool:
    pool = Pool(settings(), backing=FdBacking(memfd, "tenant t's memory"), **kwargs)  # type: ignore[arg-type]
    pool.start()
    return pool


def test_the_pool_maps_the_memfd_and_names_no_path(memfd: int) -> None:
    pool = start(memfd)
    try:
        assert pool.wait_ready(10)
        assert pool.path is None and pool.region.intact() and pool.region.file_problem() is None
        reg = pool.register(build_spec(), 1, SLOT, "rank-0", 7)
        assert [r.path for r in reg.regions] == [""]  # the client maps the fd it received
        assert pool.adoption.outcome == "new" and "held no pool index" in pool.adoption.reason
        # the pool's bytes are the memfd's: what it wrote (its header) reads through the fd
        assert os.pread(memfd, 8, SIZE - 4096) == b"KVOFFPL\x00"
    finally:
        pool.close(remove=True)
    st = os.fstat(memfd)
    assert st.st_size == SIZE and st.st_nlink == 0  # never resized, nothing to unlink
    assert os.pread(memfd, 8, SIZE - 4096) == b"KVOFFPL\x00"  # and kept for the next pool


@pytest.mark.parametrize(
    ("size", "seals", "problem"),
    [(SIZE // 2, SEALS, "holds 4194304 bytes"), (SIZE, 0, "not sealed against resize")],
)
def test_a_memfd_of_another_size_or_unsealed_is_refused(size: int, seals: int, problem: str):
    fd = sealed_memfd(size, seals)
    try:
        pool = Pool(settings(), backing=FdBacking(fd, "tenant t's memory"))
        with pytest.raises(ValueError, match=problem):
            pool.start()
        pool.close()
        assert os.fstat(fd).st_size == size  # not sized to fit
    finally:
        os.close(fd)


def test_the_prefault_allocates_each_range_through_the_caller_and_gates_slots(memfd: int):
    calls: list[tuple[int, int]] = []
    lock = threading.Lock()

    def allocate(offset: int, length: int) -> None:
        with lock:
            calls.append((offset, length))
        os.posix_fallocate(memfd, offset, length)  # as the holder does, in its own process

    gate = PrefaultGate()
    backing = FdBacking(memfd, "tenant t's memory", allocate)
    pool = Pool(settings(), backing=backing, prefault_gate=gate)
    pool.start()
    try:
        reg = pool.register(build_spec(), 1, SLOT, "rank-0", 7)
        engine = Engine(memfd, pool, 7)
        assert not reg.pool_ready
        assert pool.reserve_store(reg.namespace_id, reg.client_id, pack_keys([1])).store_id == 0
        gate.step(2)  # the namespace's region first: two 1 MiB chunks, one slot each
        res = pool.reserve_store(reg.namespace_id, reg.client_id, pack_keys([1, 2, 3]))
        assert len(res.slots) == 2  # only slots behind the pre-fault
        gate.close()
        assert pool.wait_ready(10)
        with lock:
            ranges = sorted(calls)
        assert ranges == [(i * MiB, MiB) for i in range(SIZE // MiB)]  # each range once
        assert os.fstat(memfd).st_blocks * 512 >= SIZE
        engine.die()
    finally:
        pool.close()


def test_a_memfd_already_allocated_needs_no_prefault(memfd: int) -> None:
    os.posix_fallocate(memfd, 0, SIZE)  # the holder pre-faulted it before the agent came

    def allocate(offset: int, length: int) -> None:
        raise AssertionError("nothing to allocate")

    pool = Pool(settings(), backing=FdBacking(memfd, "t", allocate))
    pool.start()
    try:
        assert pool.wait_ready(10) and pool.stats().prefaulted_bytes == SIZE
    finally:
        pool.close()


def test_engine_locks_on_other_descriptions_are_seen_and_die_with_them(memfd: int) -> None:
    pool = start(memfd)
    try:
        assert pool.wait_ready(10)
        reg = pool.register(build_spec(), 1, SLOT, "rank-0", 9)
        ns = reg.namespace_id
        # no lock: the agent's F_OFD_GETLK sees no writer, so no slot is reserved
        assert pool.reserve_store(ns, reg.client_id, pack_keys([1])).store_id == 0
        engine = Engine(memfd, pool, 9)
        res = pool.reserve_store(ns, reg.client_id, pack_keys([1, 2]))
        assert res.store_id and len(res.slots) == 2
        assert pool.reclaim_dead_engines() == 0  # alive: its reservation stays
        engine.die()  # the description's last fd: the kernel drops the lock
        assert pool.reclaim_dead_engines() == 2
    finally:
        pool.close()


def test_a_new_pool_over_the_same_memfd_adopts_its_index(memfd: int) -> None:
    first = start(memfd)
    assert first.wait_ready(10)
    reg = first.register(build_spec(), 1, SLOT, "rank-0", 5)
    engine = Engine(memfd, first, 5)
    res = first.reserve_store(reg.namespace_id, reg.client_id, pack_keys([11, 12]))
    assert first.commit_store(reg.namespace_id, res.store_id, 0, epoch=first.epoch, engine=5)
    generation = first.generation
    first.close()  # as an agent SIGKILL leaves it: the memory stays with its holder
    engine.die()
    second = start(memfd)
    try:
        assert second.adoption.outcome == "adopted" and second.adoption.adopted_blocks == 2
        assert second.generation == generation
        again = second.register(build_spec(), 1, SLOT, "rank-0", 6)
        assert second.lookup(again.namespace_id, [pack_keys([11, 12])]) == [2]
    finally:
        second.close()


def test_rebuild_maps_the_same_memory_again(memfd: int) -> None:
    pool = start(memfd)
    try:
        assert pool.wait_ready(10)
        region = pool.region
        region.stop_prefault()
        with pool._lock:
            region.rebuild()
        region.start_prefault()
        assert pool.wait_ready(10)
        os.pwrite(memfd, b"same", 0)
        assert region.buffer[0:4] == b"same" and os.fstat(memfd).st_size == SIZE
    finally:
        pool.close()
