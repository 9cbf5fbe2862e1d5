"""One driver call for a staging piece's DMA runs: ``cuMemcpyBatchAsync`` through ctypes.

Why: through cuda-python each ``cuMemcpyAsync`` costs ~10 µs of host time, and a 1 GiB job of
16 KiB pages is ~107 slot runs, most of ``submit()``'s ~2 ms; both directions submitted from
one thread then start ~1 ms apart. The batch call (CUDA 12.8+) takes the runs as three arrays
(numpy here: no per-run Python, no per-entry conversion as cuda-python's wrapper does). Each
run stays inside one ``cudaHostRegister`` piece of the pool (``plan.py`` cuts them so), copies
in stream order, and the copy engines move it as they move a ``cuMemcpyAsync``.

``BatchCopy.load()`` answers None where the driver has no batch call (older than 12.8, or no
CUDA at all): the engine then issues one ``cuMemcpyAsync`` per run, as before.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

# cuda.h (12.8+): CUmemcpySrcAccessOrder, CUmemLocationType
_SRC_ACCESS_ORDER_STREAM = 1
_LOCATION_DEVICE, _LOCATION_HOST = 1, 2
_PREFER_OVERLAP = 1  # CUmemcpyFlags: CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):
    """CUmemcpyAttributes: 24 bytes on every 64-bit ABI CUDA supports."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _Location),
        ("dstLocHint", _Location),
        ("flags", ctypes.c_uint),
    ]


@dataclass(frozen=True)
class CopyRuns:
    """One piece's DMA runs as the batch call takes them: rows dst, src, size of one uint64
    C-contiguous table, so the three array addresses come from one pointer read."""

    table: np.ndarray  # uint64 [3, n]

    @classmethod
    def of(cls, runs: np.ndarray, pool_base: int, staging: int, to_pool: bool) -> CopyRuns:
        """``runs``: rows of (pool offset, staging offset, bytes), as ``Piece.runs``."""
        r = np.asarray(runs, dtype=np.uint64).reshape(-1, 3).T
        table = np.empty((3, r.shape[1]), dtype=np.uint64)
        np.add(r[0], np.uint64(pool_base), out=table[0 if to_pool else 1])
        np.add(r[1], np.uint64(staging), out=table[1 if to_pool else 0])
        table[2] = r[2]
        return cls(table)

    @property
    def dst(self) -> np.ndarray:
        return self.table[0]

    @property
    def src(self) -> np.ndarray:
        return self.table[1]

    @property
    def size(self) -> np.ndarray:
        return self.table[2]


class BatchCopy:
    """``cuMemcpyBatchAsync`` of a driver that has it, for one device."""

    def __init__(
        self, fn: ctypes._CFuncPtr, with_fail_index: bool, device: int, flags: int = 0
    ) -> None:
        self._fn = fn
        self._fail_index = with_fail_index  # the 12.8/12.9 signature; 13.0 dropped it (_v2)
        host, dev = _Location(_LOCATION_HOST, 0), _Location(_LOCATION_DEVICE, device)
        self._h2d = ctypes.pointer(_Attributes(_SRC_ACCESS_ORDER_STREAM, host, dev, flags))
        self._d2h = ctypes.pointer(_Attributes(_SRC_ACCESS_ORDER_STREAM, dev, host, flags))
        self._index = (ctypes.c_size_t * 1)(0)  # every run uses attributes 0
        self._fail = ctypes.c_size_t(0)  # the caller (the engine) holds its lock
        self._fail_ptr = ctypes.pointer(self._fail)
        # typed once: plain ints convert in C, no ctypes object per argument per call
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        attrs, index = ctypes.POINTER(_Attributes), ctypes.POINTER(ctypes.c_size_t)
        fail = [ctypes.POINTER(ctypes.c_size_t)] if with_fail_index else []
        fn.argtypes = [vp, vp, vp, sz, attrs, index, sz, *fail, vp]

    @classmethod
    def load(cls, device: int, prefer_overlap: bool = False) -> BatchCopy | None:
        """``prefer_overlap``: CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE (for copies beside a
        forward; the engine's large runs do not set it)."""
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return None
        for name, fail_index in (("cuMemcpyBatchAsync_v2", False), ("cuMemcpyBatchAsync", True)):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.restype = ctypes.c_int
                return cls(fn, fail_index, device, _PREFER_OVERLAP if prefer_overlap else 0)
        return None

    def __call__(self, runs: CopyRuns, to_pool: bool, stream: int) -> None:
        """Queue the runs on ``stream`` (a raw CUstream handle); RuntimeError on a driver
        error (the engine then fails the job)."""
        n = runs.table.shape[1]
        if n == 0:
            return
        dst = runs.table.ctypes.data
        args = [dst, dst + 8 * n, dst + 16 * n, n, self._d2h if to_pool else self._h2d]
        args += [self._index, 1]
        if self._fail_index:
            self._fail.value = 0
            args.append(self._fail_ptr)
        err = self._fn(*args, stream)
        if err:
            where = f" (run {self._fail.value})" if self._fail_index else ""
            raise RuntimeError(f"cuMemcpyBatchAsync failed: CUresult {err}{where}")
