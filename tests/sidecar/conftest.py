"""Shared fixtures for the sidecar tests (pool core and server alike).

- `pool_dir`: an empty directory on tmpfs (/dev/shm) when there is one, else under tmp_path.
- `small_spec(**overrides)`: a valid `NamespaceSpec` (tp_size 1, key_size 8 unless overridden).
- `make_keys(ints, key_size=8)`: packed keys, one per integer (big-endian, zero-padded).
- `key_of(i, key_size=8)`: one key.
- `clock`: a manual clock (`clock.advance(s)`), for client-timeout tests.
- `vector_min`: parametrized over the default `VECTOR_MIN` and 1, so a test runs once with
  the numpy batch paths of the index and allocator taken from 2 slots up (not only above 16).
- `make_pool(**settings)`: a started `Pool` in `pool_dir`, closed after the test. Keyword
  arguments override `PoolSettings` fields (defaults: 8 MiB, 1 MiB pre-fault chunks); `clock=` and
  `prefault_gate=` go to the constructor; `start=False` returns it unstarted. Without a gate it
  waits for the pre-fault to finish, so tests see every slot ready (no race with the thread).
  Engine liveness (engine_locks.py) is a `ModelLocks` unless `liveness=` says otherwise
  (`liveness=None`: the real F_OFD_GETLK probe of the pool file): every engine holds every
  rank's lock until a test calls `pool_locks.kill(engine)` (the pool's `.locks`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest
from kvoffload_sidecar import allocator
from kvoffload_sidecar.keys import NamespaceSpec, PoolKey
from kvoffload_sidecar.pool import Pool, PoolSettings

MiB = 1 << 20


@pytest.fixture
def pool_dir(tmp_path: Path) -> Iterator[Path]:
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        d = Path(tempfile.mkdtemp(prefix="kvoffload-test-", dir="/dev/shm"))
        try:
            yield d
        finally:
            shutil.rmtree(d, ignore_errors=True)
    else:
        d = tmp_path / "pool"
        d.mkdir()
        yield d


def build_spec(**overrides: object) -> NamespaceSpec:
    fields: dict[str, object] = dict(
        model="test-model",
        dtype="bfloat16",
        kv_layout="LBHNC/packed-kv",
        block_size=16,
        chunk_blocks=1,
        tp_size=1,
        hash_algo="sha256",
        key_size=8,
    )
    fields.update(overrides)
    return NamespaceSpec(**fields)  # type: ignore[arg-type]


def key_bytes(i: int, key_size: int = 8) -> PoolKey:
    return PoolKey(i.to_bytes(key_size, "big"))


def pack_keys(ints: Iterable[int], key_size: int = 8) -> bytes:
    return b"".join(i.to_bytes(key_size, "big") for i in ints)


@pytest.fixture
def small_spec() -> Callable[..., NamespaceSpec]:
    return build_spec


@pytest.fixture
def make_keys() -> Callable[..., bytes]:
    return pack_keys


@pytest.fixture
def key_of() -> Callable[..., PoolKey]:
    return key_bytes


class ModelLocks:
    """Engine locks as a model: every lock byte is held, except the engines killed (every
    rank's byte of theirs free) or the single bytes dropped."""

    def __init__(self) -> None:
        self.dead: set[int] = set()  # engine keys
        self.free_bytes: set[int] = set()
        self.pool: Pool | None = None  # whose generation's range holds the locks

    def kill(self, engine: int) -> None:
        self.dead.add(engine)

    def __call__(self, start: int, length: int) -> bool:
        from kvoffload_sidecar.engine_locks import ENGINE_SHIFT, GEN_SPAN, MAX_RANKS

        base = self.pool.lock_base if self.pool is not None else 0
        if not base or not base <= start < base + GEN_SPAN or length > MAX_RANKS:
            return False  # a whole generation's range: no worker of it (or earlier writer)
        for offset in range(start, start + min(length, 256)):
            engine = (offset - base) >> ENGINE_SHIFT
            if engine not in self.dead and offset not in self.free_bytes:
                return True
        return False


class ManualClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture(params=["default", 1])
def vector_min(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    if request.param != "default":
        monkeypatch.setattr(allocator, "VECTOR_MIN", request.param)
    return allocator.VECTOR_MIN


INDEX_ROOM = 16 << 10
"""What the pool file keeps besides slots in the tests' small pools: its 4 KiB header, and per
partition a 4 KiB namespace header, a page of spec and a page of slot table (persist.py). The
default test pool is 8 MiB of slots plus this: 8 slots of 1 MiB, 4 per rank with tp 2."""


@pytest.fixture
def make_pool(pool_dir: Path) -> Iterator[Callable[..., Pool]]:
    pools: list[Pool] = []

    def make(
        *,
        start: bool = True,
        clock=None,
        prefault_gate=None,
        liveness: object = "model",
        **overrides: object,
    ) -> Pool:
        settings: dict[str, object] = dict(
            pool_size=8 * MiB + INDEX_ROOM, pool_dir=pool_dir, prefault_chunk_bytes=1 * MiB
        )
        settings.update(overrides)
        locks = ModelLocks() if liveness == "model" else None
        kwargs: dict[str, object] = {"prefault_gate": prefault_gate}
        kwargs["liveness"] = locks if liveness == "model" else liveness
        if clock is not None:
            kwargs["clock"] = clock
        pool = Pool(PoolSettings(**settings), **kwargs)  # type: ignore[arg-type]
        pool.locks = locks  # type: ignore[attr-defined]
        if locks is not None:
            locks.pool = pool
        pools.append(pool)
        if start:
            pool.start()
            if prefault_gate is None:
                assert pool.wait_ready(30), "pool pre-fault did not finish in 30 s"
        return pool

    yield make
    for pool in pools:
        pool.close()
