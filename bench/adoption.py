"""What re-adopting the pool costs a restarted sidecar, per GiB of pool and per block (the aim:
serving again within 1 s for a 64 GiB pool, growing with blocks, not bytes). Every row fills
half the pool (slot bytes = pool bytes / (2 x blocks)).

- `inproc`: a `Pool` commits N blocks into a sparse pool file of S bytes (`prefault=False`:
  256 GiB cost no memory), then a second `Pool` adopts the file: its `start()` and
  `Stats.adoption.adopt_seconds`. Rows vary S at fixed N and N at fixed S.
- `process`: the real `kvoffload sidecar` on a pre-faulted pool, filled over the client,
  SIGKILLed and started again: start -> Stats answering with the blocks adopted, and -> the
  first lookup that hits. Needs the pool's bytes in memory (as root without --dir it mounts a
  tmpfs of the largest pool + 1 GiB).

    python -m bench adoption [--mode inproc|process] [--sizes-gib 1,8,64,256]
        [--blocks 10000,100000,1000000] [--reps 3] [--dir DIR] [--out JSON]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import report, spread  # noqa: E402

GiB = 1 << 30
KEY_SIZE = 34  # a connector key: 32-byte block hash + 2-byte group
BATCH = 65536  # keys per store call (MAX_KEYS_PER_CALL)
SPEC = dict(model="bench/adoption", dtype="bfloat16", kv_layout="LBHNC/packed-kv", block_size=16,
            chunk_blocks=4, tp_size=1, hash_algo="sha256", key_size=KEY_SIZE)  # fmt: skip


@contextlib.contextmanager
def pool_dir(given: str | None, size: int) -> Iterator[Path]:
    if given:
        yield Path(given)
        return
    where = Path(tempfile.mkdtemp(prefix="kvo-adopt-"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0777", "tmpfs", str(where)],
        check=False,
        capture_output=True,
    )
    if mounted.returncode != 0:  # not root: /dev/shm, when it has the room
        where.rmdir()
        with tempfile.TemporaryDirectory(prefix="kvo-adopt-", dir="/dev/shm") as shm:
            yield Path(shm)
        return
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        with contextlib.suppress(OSError):
            where.rmdir()


def fill_pool(pool, n_blocks: int, slot_bytes: int) -> tuple[str, bytes]:  # noqa: ANN001
    """Register and commit n blocks of random keys; the namespace id and one stored key."""
    from kvoffload_sidecar.keys import NamespaceSpec

    reg = pool.register(NamespaceSpec(**SPEC), 1, slot_bytes, "bench/fill")
    ns, cid = reg.namespace_id, reg.client_id
    first = b""
    left = n_blocks
    while left > 0:
        n = min(BATCH, left)
        packed = os.urandom(n * KEY_SIZE)
        first = packed[:KEY_SIZE]  # of the last batch: surely not evicted
        res = pool.reserve_store(ns, cid, packed)
        if res.store_id:
            pool.commit_store(ns, res.store_id, 0)
        left -= n
    return ns, first


def half_full_slot(pool_bytes: int, n_blocks: int) -> int:
    """Slot bytes for which n blocks fill half the pool (a multiple of 16, as the pool wants)."""
    return max(16, pool_bytes // (2 * n_blocks) // 16 * 16)


def inproc_row(where: Path, pool_bytes: int, n_blocks: int, reps: int) -> dict:
    from kvoffload_sidecar.pool import Pool, PoolSettings

    for f in where.glob("pool-*"):
        f.unlink()
    slot_bytes = half_full_slot(pool_bytes, n_blocks)
    settings = PoolSettings(pool_size=pool_bytes, pool_dir=where, prefault=False)
    alive = lambda start, length: length <= 256  # noqa: E731 - the engine's ranks hold locks
    first = Pool(settings, liveness=alive)
    first.start()
    ns, key = fill_pool(first, n_blocks, slot_bytes)
    committed = first.stats().namespaces[0].committed_slots
    first.close()  # the file stays, as after a kill (close writes nothing to it)
    starts, adopts = [], []
    adopted = 0
    for _ in range(reps):
        t0 = time.perf_counter()
        again = Pool(settings, liveness=alive)
        again.start()
        starts.append(time.perf_counter() - t0)
        stats = again.stats()
        adopts.append(stats.adoption.seconds)
        adopted = stats.adoption.adopted_blocks
        assert stats.adoption.outcome == "adopted", stats.adoption
        assert again.lookup(ns, [key]) == [1], "an adopted block does not hit"
        again.close()
    table_bytes = os.stat(where / "pool-0.shm").st_blocks * 512
    s, a = spread(starts), spread(adopts)
    return {
        "pool_gib": pool_bytes / GiB,
        "slot_kib": slot_bytes / 1024,
        "blocks": committed,
        "adopted": adopted,
        "start_s_p50": s["p50"],
        "start_s_max": s["max"],
        "adopt_s_p50": a["p50"],
        "us_per_block": a["p50"] / max(adopted, 1) * 1e6,
        "file_pages_mib": table_bytes / (1 << 20),
    }


def run_inproc(args: argparse.Namespace) -> list[dict]:
    sizes = [float(x) for x in args.sizes_gib.split(",")]
    blocks = [int(x) for x in args.blocks.split(",")]
    rows = []
    with pool_dir(args.dir, int(max(sizes) * GiB) + GiB) as where:
        fixed_n = blocks[len(blocks) // 2]
        for size in sizes:  # bytes vary, blocks fixed
            rows.append(inproc_row(where, int(size * GiB), fixed_n, args.reps))
            print(rows[-1], flush=True)
        biggest = int(max(sizes) * GiB)
        for n in blocks:  # blocks vary, bytes fixed
            if n == fixed_n:
                continue
            rows.append(inproc_row(where, biggest, n, args.reps))
            print(rows[-1], flush=True)
    return rows


# -- the real process -------------------------------------------------------------------------


def sidecar_cmd(where: Path, sock: Path, pool_bytes: int) -> list[str]:
    exe = Path(sys.executable).with_name("kvoffload")
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "kvoffload_cli.main"]
    return [*base, "sidecar", "--pool-dir", str(where), "--pool-size", str(pool_bytes),
            "--socket", str(sock)]  # fmt: skip


def wait_stats(sock: Path, deadline_s: float):  # noqa: ANN201
    import grpc
    from kvoffload.v1 import pool_pb2, pool_pb2_grpc

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if sock.exists():
            with grpc.insecure_channel(f"unix:{sock}") as ch:
                try:
                    return pool_pb2_grpc.KVPoolStub(ch).Stats(pool_pb2.StatsRequest(), timeout=1)
                except grpc.RpcError:
                    pass
        time.sleep(0.005)
    raise TimeoutError("the sidecar did not answer Stats")


def run_process(args: argparse.Namespace) -> list[dict]:
    from kvoffload_connector.common.client import PoolClient
    from kvoffload_connector.common.keys import SpecFields
    from kvoffload_connector.worker.engine_lock import EngineLock, lock_offset

    sizes = [float(x) for x in args.sizes_gib.split(",")]
    blocks = [int(x) for x in args.blocks.split(",")]
    rows = []
    for size in sizes:
        pool_bytes = int(size * GiB)
        with pool_dir(args.dir, pool_bytes + GiB) as where, tempfile.TemporaryDirectory() as run:
            sock = Path(run) / "pool.sock"
            for n in blocks:
                for f in where.glob("pool-*"):
                    f.unlink()
                slot = half_full_slot(pool_bytes, n)
                proc = subprocess.Popen(sidecar_cmd(where, sock, pool_bytes))
                wait_stats(sock, 60)
                while not wait_stats(sock, 5).pool_ready:  # the whole pre-fault, first start only
                    time.sleep(0.2)
                client = PoolClient(str(sock), "bench/fill", rpc_timeout_s=30, engine=1)
                reg = client.register(SpecFields(**SPEC), 1, slot)
                rank = EngineLock(reg.regions[0].path, lock_offset(reg.engine_lock_base, 1, 0))
                first = None
                for i in range(0, n, 4096):
                    keys = [os.urandom(KEY_SIZE) for _ in range(min(4096, n - i))]
                    first = keys[0]  # of the last batch: surely not evicted
                    res = client.reserve_store(keys)
                    if res.store_id:
                        client.commit_store(
                            reg.namespace_id, res.store_id, 0, epoch=reg.epoch, engine=1
                        )
                committed = wait_stats(sock, 5).namespaces[0].committed_slots
                client.close()
                rank.release()
                serve, hit = [], []
                adopted = 0
                for _ in range(args.reps):
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
                    t0 = time.perf_counter()
                    proc = subprocess.Popen(sidecar_cmd(where, sock, pool_bytes))
                    stats = wait_stats(sock, 60)
                    serve.append(time.perf_counter() - t0)
                    adopted = stats.adoption.adopted_blocks
                    assert stats.adoption.outcome == "adopted", stats.adoption
                    c = PoolClient(str(sock), "bench/probe", rpc_timeout_s=10)
                    c.register(SpecFields(**SPEC), 1, slot)
                    assert c.lookup([[first]]) == [1]
                    hit.append(time.perf_counter() - t0)
                    c.close()
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=30)
                s, h = spread(serve), spread(hit)
                rows.append({
                    "pool_gib": size,
                    "slot_kib": slot >> 10,
                    "blocks": committed,
                    "adopted": adopted,
                    "start_to_stats_s_p50": s["p50"],
                    "start_to_stats_s_max": s["max"],
                    "start_to_first_hit_s_p50": h["p50"],
                    "start_to_first_hit_s_max": h["max"],
                })  # fmt: skip
                print(rows[-1], flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("inproc", "process"), default="inproc")
    ap.add_argument("--sizes-gib", default="1,8,64,256")
    ap.add_argument("--blocks", default="10000,100000,1000000")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default="bench/out/adoption.json")
    args = ap.parse_args()
    rows = run_inproc(args) if args.mode == "inproc" else run_process(args)
    report(f"pool adoption ({args.mode})", rows, args.out, extra={"args": vars(args)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
