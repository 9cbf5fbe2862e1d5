"""The test process as every worker rank of one engine: what a PoolClient needs to store.

The sidecar grants an engine's store reservations only while each of its ranks holds its lock
byte of the pool file (engine_lock.py), and a commit names the sidecar instance and engine."""

from __future__ import annotations

from kvoffload_connector.common.client import PoolClient, RegisterResult
from kvoffload_connector.worker.engine_lock import EngineLock, lock_offset

ENGINE = 0x51DF


def new_client(*args, **kwargs) -> PoolClient:
    return PoolClient(*args, engine=ENGINE, **kwargs)


def hold(reg: RegisterResult, ranks: int = 1) -> list[EngineLock]:
    """Every rank's lock for the registration's generation (release them, or exit)."""
    return [
        EngineLock(reg.regions[0].path, lock_offset(reg.engine_lock_base, reg.engine, r))
        for r in range(ranks)
    ]


def commit(c: PoolClient, reg: RegisterResult, store_id: int, rank: int = 0) -> bool:
    return c.commit_store(reg.namespace_id, store_id, rank, epoch=reg.epoch, engine=reg.engine)
