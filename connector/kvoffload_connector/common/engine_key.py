"""The engine's key: the number that names one vLLM engine to the sidecar.

The scheduler and every worker rank of an engine derive it from the same start facts, with no
message between them: the scheduler sends it with its lookups and stores, each rank locks its
byte of the pool file under it (worker/engine_lock.py). Stdlib only.
"""

from __future__ import annotations

import hashlib

__all__ = ["ENGINE_SHIFT", "MAX_ENGINE", "engine_key"]

ENGINE_SHIFT = 8  # rank bits (kvoffload_sidecar.engine_locks: the same contract)
MAX_ENGINE = 1 << 34


def engine_key(start: tuple[str, ...]) -> int:
    """The engine's key from what names its start in every process of it (`compat.engine_start`):
    the scheduler and its workers agree on it with no message between them, so each rank holds
    its lock from its registration on, before the first step's stores are reserved."""
    digest = hashlib.blake2b("\0".join(start).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (MAX_ENGINE - 1) + 1
