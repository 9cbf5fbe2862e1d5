"""The transfer-engine factory, above what it builds: `make_engine` picks the engine for a
device. The shared types live in `contract.py` (re-exported here for older imports)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload_connector.worker.transfer.contract import (
    BatchValidator,
    Direction,
    JobResult,
    TransferBatch,
    TransferEngine,
    validate_batches,
)

if TYPE_CHECKING:
    import torch

    from kvoffload_connector.worker.layout import CanonicalLayout
    from kvoffload_connector.worker.pool_view import PoolView

__all__ = [
    "BatchValidator",
    "Direction",
    "JobResult",
    "TransferBatch",
    "TransferEngine",
    "make_engine",
    "validate_batches",
]


def make_engine(
    layout: CanonicalLayout, pool: PoolView, device: torch.device, store_ctas: int = 8
) -> TransferEngine:
    """CPU device -> CpuTorchEngine (worker thread); CUDA device -> CudaEngine, whose store
    gather kernel occupies at most ``store_ctas`` SMs."""
    if device.type == "cuda":
        from kvoffload_connector.worker.transfer.cuda import CudaEngine

        return CudaEngine(layout, pool, device, store_ctas=store_ctas)
    if device.type == "cpu":
        from kvoffload_connector.worker.transfer.cpu import CpuTorchEngine

        return CpuTorchEngine(layout, pool)
    raise ValueError(f"no transfer engine for device type {device.type!r}")
