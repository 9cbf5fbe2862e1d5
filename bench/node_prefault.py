"""What making a node-mode tenant's memfd resident costs, per GiB, by method and threads (can a
1 TiB node pool serve within seconds of the agent starting?). Each method on a fresh sealed
memfd of --gib GiB, one contiguous range per thread: `fallocate` (`posix_fallocate`, the
agent's pre-fault), `populate` (`MADV_POPULATE_WRITE` over a shared mapping), `populate_thp`
(the same after `MADV_HUGEPAGE`, where `shmem_enabled` allows), `fallocate_tenants` (a memfd
per thread, side by side). The pages are charged to this process's memory cgroup.

`cuda_register` (a GPU, not in the default methods) measures what a pod attaching to a tenant
pays instead: the connector's own mapping of a pre-faulted memfd (`PoolView.open_fd`, 2 MiB
slots) page-locked with CUDA in its pieces (`cudaHostRegister`, 1 GiB each, one thread), with
the time until the first piece is usable (hits start there) beside the whole region's.

    python -m bench node_prefault [--gib 16] [--threads 1,4,8,16] [--reps 2] [--out JSON]
    python -m bench node_prefault --gib 32 --methods fallocate,cuda_register --threads 1
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import report  # noqa: E402
from kvoffload_sidecar.node.tenant_memory import create_memfd  # noqa: E402

GiB = 1 << 30
THP = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux 5.14+
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def _madvise(addr: int, length: int, advice: int) -> None:
    # through ctypes: the GIL is released, so threads fault in parallel
    if _libc.madvise(addr, length, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _ranges(size: int, threads: int) -> list[tuple[int, int]]:
    step = (size // threads) // (2 << 20) * (2 << 20)
    return [(i * step, size - i * step if i == threads - 1 else step) for i in range(threads)]


def parallel(work: list) -> float:
    """Seconds for the callables in `work`, each on its own thread (the first error raised)."""
    errors: list[BaseException] = []

    def wrap(fn) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 (raised below)
            errors.append(e)

    ts = [threading.Thread(target=wrap, args=(w,)) for w in work]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def run_once(method: str, size: int, threads: int) -> float:
    """Seconds to make `size` bytes resident by `method` on `threads` threads."""
    if method == "fallocate_tenants":  # one memfd per thread, scaled to `size`
        part = size // threads // (2 << 20) * (2 << 20)
        fds = [create_memfd(f"bench-{i}", part) for i in range(threads)]
        try:
            seconds = parallel([lambda fd=fd: os.posix_fallocate(fd, 0, part) for fd in fds])
            return seconds * size / (part * threads)
        finally:
            for fd in fds:
                os.close(fd)
    fd = create_memfd("bench", size)
    m = None
    try:
        if method == "fallocate":
            return parallel(
                [lambda o=o, n=n: os.posix_fallocate(fd, o, n) for o, n in _ranges(size, threads)]
            )
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))
        if method == "populate_thp":
            _madvise(base, size, MADV_HUGEPAGE)
        return parallel(
            [
                lambda o=o, n=n: _madvise(base + o, n, MADV_POPULATE_WRITE)
                for o, n in _ranges(size, threads)
            ]
        )
    finally:
        if m is not None:
            m.close()
        os.close(fd)


def register_once(size: int) -> tuple[float, float]:
    """(seconds until the first piece is usable, seconds for every piece) of the connector's
    CUDA registration of its mapping of a pre-faulted memfd of `size` bytes."""
    import torch
    from kvoffload_connector.worker.pool_view import PoolView

    slot = 2 << 20
    fd = create_memfd("bench", size)
    try:
        os.posix_fallocate(fd, 0, size)  # the holder's pre-fault: not timed
        view = PoolView.open_fd(fd, "bench", 0, slot, size // slot)
        try:
            view.start_device_registration(torch.device("cuda"))
            if not (view.wait_ready(900) and view.registered):
                raise RuntimeError(f"registration failed: {view.error}")
            return view.progress[0][0], view.progress[-1][0]
        finally:
            view.close()
    finally:
        os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=16)
    ap.add_argument("--threads", default="1,4,8,16")
    ap.add_argument("--methods", default="fallocate,fallocate_tenants,populate,populate_thp")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default="bench/out/node_prefault.json")
    args = ap.parse_args()
    size = int(args.gib * GiB) // (2 << 20) * (2 << 20)
    rows = []
    for method in args.methods.split(","):
        if method == "cuda_register":  # one registration thread, as each worker rank has
            runs = [register_once(size) for _ in range(args.reps)]
            first, best = min(r[0] for r in runs), min(r[1] for r in runs)
            rows.append({
                "method": method,
                "threads": 1,
                "gib": round(size / GiB, 2),
                "seconds": round(best, 3),
                "first_piece_s": round(first, 3),
                "gb_per_s": round(size / best / 1e9, 2),
                "ms_per_gib": round(best / (size / GiB) * 1e3, 1),
                "est_1tib_s": round(best / (size / GiB) * 1024, 1),
            })  # fmt: skip
            print(rows[-1], flush=True)
            continue
        for threads in (int(t) for t in args.threads.split(",")):
            best = min(run_once(method, size, threads) for _ in range(args.reps))
            s_per_gib = best / (size / GiB)
            rows.append({
                "method": method,
                "threads": threads,
                "gib": round(size / GiB, 2),
                "seconds": round(best, 3),
                "gb_per_s": round(size / best / 1e9, 2),
                "ms_per_gib": round(s_per_gib * 1e3, 1),
                "est_1tib_s": round(s_per_gib * 1024, 1),
            })  # fmt: skip
            print(rows[-1], flush=True)
    report(
        "node pool pre-fault (memfd)",
        rows,
        args.out,
        extra={
            "args": vars(args),
            "shmem_enabled": THP.read_text().strip() if THP.exists() else "-",
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
