"""The gather/scatter kernel between KV storage regions and a staging buffer (NVRTC + driver API).

One kernel, ``kv_copy_<W>`` for vector widths W in {16, 8, 4, 2, 1} bytes. The other side of
the copy is a staging buffer (block b at ``staging + b * block_bytes``) or, given a per-block
address array, anywhere in the GPU's address space: the pool itself through its UVA mapping, for
layer-by-layer loads that skip staging. Work unit: one warp
copies up to ``32 * W * UNROLL`` bytes (4 KiB at W=16) of one region of one block, UNROLL
independent loads in flight per lane before the stores; warps stride over the units of all
(block, region) pairs, so any mix of region sizes keeps every warp busy. The grid size is the
caller's SM budget: one CTA of 512 threads per SM at most.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from kvoffload_connector.worker.transfer.cuda_driver import driver_results

__all__ = ["CopyKernels", "THREADS", "UNROLL", "vector_width"]

THREADS = 512
UNROLL = 8
WIDTHS = (16, 8, 4, 2, 1)
_OFFSETS = np.arange(9, dtype=np.uint64) * 8

_SOURCE = r"""
struct alignas(16) V16 { unsigned long long a, b; };
struct alignas(8) V8 { unsigned long long a; };
struct alignas(4) V4 { unsigned int a; };
struct alignas(2) V2 { unsigned short a; };
struct V1 { unsigned char a; };

template <typename V>
__device__ __forceinline__ void kv_copy(
    const long long* __restrict__ blocks, long long n_blocks,
    const long long* __restrict__ regions, long long n_regions, long long units_per_region,
    char* __restrict__ staging, long long block_bytes, int to_staging,
    const long long* __restrict__ block_addrs)
{
    constexpr long long UNIT = 32LL * sizeof(V) * UNROLL;
    const int lane = threadIdx.x & 31;
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
    const long long total = n_blocks * n_regions * units_per_region;
    for (long long u = warp; u < total; u += nwarps) {
        const long long unit = u % units_per_region;
        const long long item = u / units_per_region;
        const long long r = item % n_regions;
        const long long b = item / n_regions;
        const long long* reg = regions + 4 * r;   // addr, stride, bytes, offset in block
        const long long rbytes = reg[2];
        const long long start = unit * UNIT;
        if (start >= rbytes) continue;
        const long long nv = (rbytes - start < UNIT ? rbytes - start : UNIT) / (long long)sizeof(V);
        char* gpu = (char*)(reg[0] + blocks[b] * reg[1] + start);
        char* stg = (block_addrs ? (char*)block_addrs[b] : staging + b * block_bytes)
                    + reg[3] + start;
        const V* src = (const V*)(to_staging ? gpu : stg);
        V* dst = (V*)(to_staging ? stg : gpu);
        V tmp[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const long long i = lane + 32LL * k;
            if (i < nv) tmp[k] = src[i];
        }
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const long long i = lane + 32LL * k;
            if (i < nv) dst[i] = tmp[k];
        }
    }
}

#define KV_COPY(W) \
extern "C" __global__ void __launch_bounds__(THREADS) kv_copy_##W( \
    const long long* blocks, long long n_blocks, const long long* regions, long long n_regions, \
    long long units_per_region, char* staging, long long block_bytes, int to_staging, \
    const long long* block_addrs) { \
    kv_copy<V##W>(blocks, n_blocks, regions, n_regions, units_per_region, staging, block_bytes, \
                  to_staging, block_addrs); }
KV_COPY(16)
KV_COPY(8)
KV_COPY(4)
KV_COPY(2)
KV_COPY(1)
"""


def vector_width(values: list[int]) -> int:
    """Largest width in WIDTHS dividing every address, stride, size and offset."""
    for w in WIDTHS:
        if all(v % w == 0 for v in values):
            return w
    return 1


class CopyKernels:
    """Compiled ``kv_copy_<W>`` functions in the current CUDA context (compiled once per
    process and device capability; NVRTC emits a cubin for the exact SM, no PTX JIT). One
    instance launches from one thread at a time (its parameter block is reused)."""

    _lock = threading.Lock()
    _cache: dict[tuple[int, int, int], tuple] = {}

    def __init__(self, device_index: int, capability: tuple[int, int]) -> None:
        """Build for the current context (the caller made ``device_index`` current)."""
        from cuda.bindings import driver

        self._driver = driver
        key = (device_index, *capability)
        with self._lock:
            if key not in self._cache:
                self._cache[key] = self._build(capability)
        self._module, self._funcs = self._cache[key]
        # one parameter block per instance, rewritten per launch: cuLaunchKernel copies the
        # values at the call, and the engine launches under its lock. A numpy array and its
        # ``.ctypes`` per launch cost ~10 µs of a piece's ~60 µs of host time.
        self._vals = np.zeros(9, dtype=np.uint64)
        self._params = self._vals.ctypes.data + _OFFSETS
        self._params_ptr = self._params.ctypes.data

    def _build(self, capability: tuple[int, int]) -> tuple:
        from cuda.bindings import driver, nvrtc

        src = _SOURCE.replace("UNROLL", str(UNROLL)).replace("THREADS", str(THREADS))
        (prog,) = driver_results(
            nvrtc.nvrtcCreateProgram(src.encode(), b"kv_copy.cu", 0, [], []), "nvrtc"
        )
        arch = f"--gpu-architecture=sm_{capability[0]}{capability[1]}".encode()
        opts = [arch, b"--std=c++17"]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if int(err) != 0:
            (size,) = driver_results(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtc log")
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC failed: {log.decode(errors='replace')}")
        (size,) = driver_results(nvrtc.nvrtcGetCUBINSize(prog), "nvrtc cubin size")
        cubin = b" " * size
        driver_results(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtc cubin")
        nvrtc.nvrtcDestroyProgram(prog)
        (module,) = driver_results(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        funcs = {}
        for w in WIDTHS:
            (funcs[w],) = driver_results(
                driver.cuModuleGetFunction(module, f"kv_copy_{w}".encode()), "func"
            )
        return module, funcs

    def launch(
        self,
        width: int,
        grid: int,
        stream: Any,
        blocks_ptr: int,
        n_blocks: int,
        regions_ptr: int,
        n_regions: int,
        units_per_region: int,
        staging_ptr: int,
        block_bytes: int,
        to_staging: bool,
        block_addrs_ptr: int = 0,
    ) -> None:
        """Enqueue one copy on ``stream`` (a CUstream, or its handle as int). With
        ``block_addrs_ptr`` (a device array of n_blocks addresses) block b's bytes are at
        ``block_addrs[b]`` instead of in ``staging``."""
        if isinstance(stream, int):
            stream = self._driver.CUstream(stream)
        # one 8-byte slot per parameter (the int parameter reads the low half: little-endian)
        self._vals[:] = (
            blocks_ptr,
            n_blocks,
            regions_ptr,
            n_regions,
            units_per_region,
            staging_ptr,
            block_bytes,
            1 if to_staging else 0,
            block_addrs_ptr,
        )
        driver_results(
            self._driver.cuLaunchKernel(
                self._funcs[width],
                grid,
                1,
                1,
                THREADS,
                1,
                1,
                0,
                stream,
                self._params_ptr,
                0,
            ),
            "cuLaunchKernel",
        )


def unit_bytes(width: int) -> int:
    """Bytes one warp moves per work unit at this vector width."""
    return 32 * width * UNROLL
