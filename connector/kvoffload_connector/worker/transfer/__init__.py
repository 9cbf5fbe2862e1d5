"""Transfer engines: move KV blocks between GPU (or CPU) memory and pool slots."""

from kvoffload_connector.worker.transfer.engine import (
    Direction,
    JobResult,
    TransferBatch,
    TransferEngine,
    make_engine,
)

__all__ = ["Direction", "JobResult", "TransferBatch", "TransferEngine", "make_engine"]
