"""The ctypes side of the batched DMA call (batch_copy.py), without a GPU.

The copies themselves are checked on the GPU machine (test_transfer_gpu.py: batched and
per-run DMA write the same pool bytes). Here: the run arrays, the struct the driver reads, the
arguments each driver signature gets, the choice between them, and errors.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from kvoffload_connector.worker.transfer import batch_copy
from kvoffload_connector.worker.transfer.batch_copy import BatchCopy, CopyRuns

RUNS = np.array([[0, 0, 4096], [65536, 4096, 8192], [1 << 33, 12288, 1 << 20]], dtype=np.int64)


def test_runs_point_at_the_pool_for_stores_and_at_staging_for_loads():
    pool, staging = 0x7F00_0000_0000, 0x5000_0000
    store = CopyRuns.of(RUNS, pool, staging, to_pool=True)
    load = CopyRuns.of(RUNS, pool, staging, to_pool=False)
    assert store.dst.tolist() == [pool, pool + 65536, pool + (1 << 33)]
    assert store.src.tolist() == [staging, staging + 4096, staging + 12288]
    assert (load.dst.tolist(), load.src.tolist()) == (store.src.tolist(), store.dst.tolist())
    assert store.size.tolist() == load.size.tolist() == [4096, 8192, 1 << 20]
    for a in (store.dst, store.src, store.size):
        assert a.dtype == np.uint64 and a.flags.c_contiguous


def test_attributes_have_the_driver_layout():
    """CUmemcpyAttributes: int order, two {int type, int id} hints, unsigned flags."""
    assert ctypes.sizeof(batch_copy._Attributes) == 24
    assert batch_copy._Attributes.flags.offset == 20


class FakeLib:
    """libcuda with the named batch symbols; each records its calls, answers ``result``."""

    def __init__(self, names, result=0):
        self.calls: list[tuple[str, tuple]] = []
        for name in names:
            setattr(self, name, self._fn(name, result))

    def _fn(self, name, result):
        calls = self.calls

        def fn(*args):
            calls.append((name, args))
            if len(args) == 9:  # the 12.8 signature reports the failing run
                ctypes.cast(args[7], ctypes.POINTER(ctypes.c_size_t))[0] = 1
            return result

        return fn


@pytest.mark.parametrize(
    "names, used, nargs",
    [
        (["cuMemcpyBatchAsync_v2", "cuMemcpyBatchAsync"], "cuMemcpyBatchAsync_v2", 8),
        (["cuMemcpyBatchAsync"], "cuMemcpyBatchAsync", 9),
    ],
)
def test_prefers_the_13_0_signature_and_passes_the_arrays(monkeypatch, names, used, nargs):
    lib = FakeLib(names)
    monkeypatch.setattr(batch_copy.ctypes, "CDLL", lambda name: lib)
    copier = BatchCopy.load(device=3)
    runs = CopyRuns.of(RUNS, 1 << 40, 1 << 20, to_pool=False)
    copier(runs, to_pool=False, stream=0xABC)
    [(name, args)] = lib.calls
    assert name == used and len(args) == nargs
    assert list(args[:3]) == [
        runs.dst.ctypes.data,
        runs.src.ctypes.data,
        runs.size.ctypes.data,
    ]
    assert args[3] == 3 and args[6] == 1 and args[-1] == 0xABC
    attrs = ctypes.cast(args[4], ctypes.POINTER(batch_copy._Attributes)).contents
    assert (attrs.srcLocHint.type, attrs.dstLocHint.type, attrs.dstLocHint.id) == (2, 1, 3)
    assert attrs.flags == 0  # large runs: no preference between copy engines and SMs


def test_prefer_overlap_sets_the_driver_flag(monkeypatch):
    lib = FakeLib(["cuMemcpyBatchAsync_v2"])
    monkeypatch.setattr(batch_copy.ctypes, "CDLL", lambda name: lib)
    BatchCopy.load(0, prefer_overlap=True)(
        CopyRuns.of(RUNS, 0, 0, to_pool=True), to_pool=True, stream=1
    )
    [(_, args)] = lib.calls
    attrs = ctypes.cast(args[4], ctypes.POINTER(batch_copy._Attributes)).contents
    assert attrs.flags == 1 and (attrs.srcLocHint.type, attrs.dstLocHint.type) == (1, 2)


def test_a_driver_error_raises_and_names_the_run(monkeypatch):
    lib = FakeLib(["cuMemcpyBatchAsync"], result=1)
    monkeypatch.setattr(batch_copy.ctypes, "CDLL", lambda name: lib)
    with pytest.raises(RuntimeError, match=r"CUresult 1 \(run 1\)"):
        BatchCopy.load(0)(CopyRuns.of(RUNS, 0, 0, to_pool=True), to_pool=True, stream=1)


def test_no_batch_call_without_the_driver_or_the_symbol(monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(batch_copy.ctypes, "CDLL", missing)
    assert BatchCopy.load(0) is None
    monkeypatch.setattr(batch_copy.ctypes, "CDLL", lambda name: FakeLib(["cuMemcpyAsync"]))
    assert BatchCopy.load(0) is None


def test_an_empty_piece_calls_nothing(monkeypatch):
    lib = FakeLib(["cuMemcpyBatchAsync_v2"])
    monkeypatch.setattr(batch_copy.ctypes, "CDLL", lambda name: lib)
    BatchCopy.load(0)(CopyRuns.of(RUNS[:0], 0, 0, to_pool=True), to_pool=True, stream=1)
    assert lib.calls == []


def test_the_typed_call_passes_ints_through_c(monkeypatch):
    """A real C function pointer (a ctypes callback with the 13.0 signature) as the driver
    symbol: the engine's plain ints and struct pointers go through ctypes' own conversion."""
    seen = []
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    proto = ctypes.CFUNCTYPE(ctypes.c_int, vp, vp, vp, sz, vp, vp, sz, vp)

    def driver(dst, src, size, n, attrs, index, n_attrs, stream):
        sizes = ctypes.cast(size, ctypes.POINTER(ctypes.c_uint64))
        hint = ctypes.cast(attrs, ctypes.POINTER(batch_copy._Attributes)).contents.dstLocHint
        seen.append((dst, src, [sizes[i] for i in range(n)], n_attrs, hint.type, stream))
        return 0

    c_fn = proto(driver)
    lib = type("Lib", (), {"cuMemcpyBatchAsync_v2": ctypes.cast(c_fn, proto)})()
    monkeypatch.setattr(batch_copy.ctypes, "CDLL", lambda name: lib)
    runs = CopyRuns.of(RUNS, 1 << 40, 1 << 20, to_pool=True)
    BatchCopy.load(0)(runs, to_pool=True, stream=0xBEEF)
    [(dst, src, sizes, n_attrs, hint, stream)] = seen
    assert (dst, src) == (runs.dst.ctypes.data, runs.src.ctypes.data)
    assert sizes == [4096, 8192, 1 << 20] and n_attrs == 1 and stream == 0xBEEF
    assert hint == 2  # a store's destination is host memory
