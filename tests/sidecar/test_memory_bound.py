"""Host memory of a full pool stays within 1.02 x pool size + the process baseline (from /proc).

What the pool costs the host: the tmpfs file's allocated pages (st_blocks) plus the sidecar's
anonymous memory (index, policy, gRPC buffers). The sidecar's shared mapping of the file
(RssShmem) is the same pages as the file, so it is checked separately, not added.

The constant: a `kvoffload sidecar` with an empty pool measures ~28 MiB of anonymous memory on
the 2-core dev box (CPython + grpcio + protobuf + prometheus_client + numpy, which added ~6 MiB;
filling 4,096 slots adds ~2 MiB). The test measures it at start and allows BASELINE_LIMIT
(about 2x that, for other allocators and grpc thread arenas) for it, then 2 % of the pool for
everything the fill adds.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvoffload_sidecar.host import filesystem_type
from procs import Client, keys, sidecar_process, socket_dir, wait_ready, wire_slots

pytestmark = [pytest.mark.process, pytest.mark.timeout(180)]

POOL_SIZE = 256 << 20
SLOT_BYTES = 64 << 10  # 4,096 slots
BASELINE_LIMIT = 64 << 20
SHM = Path("/dev/shm")


def _is_tmpfs(path: Path) -> bool:
    return filesystem_type(path) == "tmpfs"


def _status_bytes(pid: int) -> dict[str, int]:
    """RssAnon / RssShmem / RssFile / VmRSS of a process in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("RssAnon", "RssShmem", "RssFile", "VmRSS"):
            out[name] = int(value.split()[0]) * 1024
    return out


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    if not _is_tmpfs(SHM):
        pytest.skip("/dev/shm is not a tmpfs here")
    path = Path(tempfile.mkdtemp(prefix="kvo-mem-", dir=SHM))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_full_pool_memory_is_bounded(shm_dir: Path) -> None:
    with socket_dir() as sock_dir, sidecar_process(shm_dir, sock_dir, pool_size="256Mi") as proc:
        pool_file = shm_dir / "pool-0.shm"
        with Client(proc.target) as client:
            wait_ready(client)
            baseline = _status_bytes(proc.pid)
            allocated = os.stat(pool_file).st_blocks * 512
            assert os.stat(pool_file).st_size == POOL_SIZE
            assert allocated == POOL_SIZE, "pre-fault complete: every page of the file allocated"
            assert baseline["RssAnon"] <= BASELINE_LIMIT, baseline

            reg = client.register(slot_bytes=SLOT_BYTES)
            region = reg.regions[0]
            n_slots = region.slot_count
            assert n_slots * SLOT_BYTES >= POOL_SIZE - (2 << 20)
            for first in range(0, n_slots, 1024):  # fill every slot, then overwrite half of them
                client.store(keys(*range(first, min(first + 1024, n_slots))))
            evicting = client.store(keys(*range(n_slots, n_slots + n_slots // 2)))
            assert len(wire_slots(evicting.slots)) == n_slots // 2
            pin = client.reserve_load(keys(*range(n_slots, n_slots + 256)))
            assert len(wire_slots(pin.slots)) == 256
            ns = client.namespace_stats()
            assert ns.committed_slots == n_slots and ns.evicted_blocks == n_slots // 2

            # what vLLM does: map the file and write every slot (not the sidecar's own memory)
            with open(pool_file, "r+b") as f, mmap.mmap(f.fileno(), POOL_SIZE) as view:
                pattern = b"\xa5" * SLOT_BYTES
                for i in range(n_slots):
                    start = region.offset + i * SLOT_BYTES
                    view[start : start + SLOT_BYTES] = pattern

            full = _status_bytes(proc.pid)
            allocated = os.stat(pool_file).st_blocks * 512
            grown = full["RssAnon"] - baseline["RssAnon"]
            attributable = allocated + full["RssAnon"]
            print(
                f"baseline anon {baseline['RssAnon'] >> 20} MiB, "
                f"full anon {full['RssAnon'] >> 20} MiB (+{grown >> 10} KiB), "
                f"shmem {full['RssShmem'] >> 20} MiB, file {allocated >> 20} MiB"
            )
            assert allocated == POOL_SIZE  # writes never grow the file
            assert full["RssShmem"] <= POOL_SIZE  # the sidecar maps the file once, no copy
            assert grown <= 0.02 * POOL_SIZE, f"anon memory grew {grown} bytes while filling"
            assert attributable <= 1.02 * POOL_SIZE + BASELINE_LIMIT, full
            client.release(pin.pin_id)
        assert proc.terminate() == 0
        assert pool_file.exists()  # kept for the next sidecar of the pod
