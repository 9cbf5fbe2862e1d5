"""The pool file truncated, removed or replaced under a live sidecar: the pool rebuilds itself.

Someone with a shell in the vLLM container can `truncate -s 0` the shared pool file. The sidecar
notices on its reaper tick (`Pool.check_file`), sizes and maps the file again under a new
generation with an empty index, and its own pre-fault never touches bytes past the file's end
(that would be SIGBUS: checked in a subprocess so a crash shows as a failure, not a dead pytest).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kvoffload_sidecar.keys import NamespaceSpec
from kvoffload_sidecar.pool import Pool
from kvoffload_sidecar.region import POOL_FILE_NAME, PrefaultGate

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


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


def pack_keys(ints: range) -> bytes:
    return b"".join(i.to_bytes(8, "big") for i in ints)


def _store_and_find(pool: Pool, ints: range) -> int:
    reg = pool.register(build_spec(), 1, 4096, "t")
    keys = pack_keys(ints)
    res = pool.reserve_store(reg.namespace_id, reg.client_id, keys)
    assert res.store_id, "no slot for a store"
    assert pool.commit_store(reg.namespace_id, res.store_id, 0)
    return pool.lookup(reg.namespace_id, [keys])[0]


@pytest.mark.parametrize("how", ["truncate", "remove", "replace"])
def test_changed_file_is_rebuilt_with_a_new_generation_and_an_empty_index(
    make_pool, how: str
) -> None:
    pool = make_pool()
    assert _store_and_find(pool, range(4)) == 4
    old = pool.generation
    assert pool.check_file() is False  # nothing happened: nothing done
    path = pool.path
    if how == "truncate":
        os.truncate(path, 0)
    else:
        path.unlink()
        if how == "replace":
            path.write_bytes(b"x" * 100)
    assert pool.check_file() is True
    assert pool.generation != old and pool.rebuilds == 1
    assert path.stat().st_size == pool.settings.pool_size
    assert pool.region.file_problem() is None
    assert pool.wait_ready(30), pool.region.error
    assert pool.stats().namespaces == ()  # the contents are gone: nothing claims otherwise
    reg = pool.register(build_spec(), 1, 4096, "t")
    assert reg.pool_generation == pool.generation
    assert pool.lookup(reg.namespace_id, [pack_keys(range(4))]) == [0]
    # stores wait out the detach grace (copies of the old generation may still land): none here
    pool._stores_from = 0.0
    assert _store_and_find(pool, range(10, 14)) == 4
    assert pool.check_file() is False


def test_a_pool_that_cannot_be_rebuilt_refuses_calls_instead_of_crashing(make_pool) -> None:
    pool = make_pool()
    pool.path.unlink()
    pool.path.mkdir()  # a directory where the file was: cannot be reused nor created
    try:
        assert pool.check_file() is True
        with pytest.raises(Exception, match="not started"):
            pool.register(build_spec(), 1, 4096, "t")
    finally:
        pool.path.rmdir()


_PREFAULT_ON_A_SHORT_FILE = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from kvoffload_sidecar.region import Region, PrefaultGate
    import threading
    gate = PrefaultGate()
    lock = threading.Lock()
    r = Region(Path(sys.argv[1]), 8 << 20, lock=lock, chunk_bytes=1 << 20, gate=gate)
    r._populate_ok = False  # the byte-per-page fallback: a store past the end is SIGBUS
    r.open()
    r.start_prefault()
    gate.step(2)
    os.truncate(r.path, 0)
    gate.close()
    r._thread.join(10)
    with lock:
        done = r.prefaulted_bytes
    print("error:", r.error, "done:", done, "problem:", r.file_problem())
    r.close()
    """
)


def test_the_prefault_stops_instead_of_touching_a_truncated_file(pool_dir: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PREFAULT_ON_A_SHORT_FILE, str(pool_dir)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, f"pre-fault crashed (rc {out.returncode}):\n{out.stderr}"
    assert "error: the pool file shrank under the mapping done: 2097152" in out.stdout, out.stdout
    assert "problem: shrank to 0 of 8388608 bytes" in out.stdout
    assert "pool pre-fault paused" in out.stderr


def test_rebuild_while_prefaulting_restarts_the_prefault(make_pool) -> None:
    gate = PrefaultGate()
    pool = make_pool(prefault_gate=gate)
    gate.step(2)
    os.truncate(pool.path, 0)
    gate.close()  # the thread runs on, finds the file short and stops; then the reaper rebuilds
    assert pool.check_file() is True
    assert pool.wait_ready(30), pool.region.error
    assert (pool.path.parent / POOL_FILE_NAME).stat().st_size == pool.settings.pool_size
