"""The CUDA driver calls' error check and the constants the CUDA engine's parts share (the
kernels' NVRTC calls use the same check)."""

from __future__ import annotations

from typing import Any

NOT_READY = 600  # CUDA_ERROR_NOT_READY: cuEventQuery on work not yet done
NO_TIMING = 2  # CU_EVENT_DISABLE_TIMING: events that only order work


def driver_results(result: tuple, what: str) -> tuple:
    """Raise on a driver (or NVRTC) error; return the call's values."""
    if int(result[0]) != 0:
        raise RuntimeError(f"{what} failed: {result[0]!r}")
    return result[1:]


def driver_ok(result: tuple, what: str) -> Any:
    """Raise on a driver error; return the call's value (if any)."""
    values = driver_results(result, what)
    return values[0] if values else None
