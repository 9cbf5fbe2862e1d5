"""Pool size → sidecar resources and emptyDir limits (pure).

Why the sidecar's memory covers the pool: pages of a memory-backed emptyDir are charged to the
memory cgroup of the container that first touches them, and the sidecar pre-faults the whole
pool file at start. So the sidecar's request and limit are ``pool + headroom`` and vLLM's own
limit need not grow. Request == limit for memory: the pool is resident for the pod's life, so
the scheduler must reserve all of it (no overcommit, no surprise OOM kill under pressure).

Headroom = 256 MiB (Python, grpcio, the metrics server) + 1/256 of the pool (the slot index,
which grows with the slot count) — 0.5 GiB for a 64 GiB pool. With hugepages the pool is charged
to ``hugepages-2Mi`` instead, and memory covers the headroom alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload_operator.policy import MIB, PoolSpec

BASE_HEADROOM_BYTES = 256 * MIB
INDEX_HEADROOM_DIVISOR = 256
EMPTYDIR_SLACK_BYTES = 16 * MIB  # tmpfs metadata, a lock file: the pool file itself is exact
RUN_DIR_LIMIT = "16Mi"  # the Unix socket's directory
PYTHON_DIR_LIMIT = "1Gi"  # the connector payload copied by the init container
SIDECAR_CPU_REQUEST = "250m"  # no CPU limit (throttling a control path adds latency) but in a
# Guaranteed pod, which any container without one would demote (inject/qos.py)


@dataclass(frozen=True)
class Sizing:
    pool_bytes: int
    headroom_bytes: int
    sidecar_requests: dict[str, str]
    sidecar_limits: dict[str, str]
    pool_medium: str  # emptyDir medium: "Memory" or "HugePages-2Mi"
    pool_size_limit: str  # emptyDir sizeLimit


def mebibytes(n: int) -> str:
    """Bytes → a quantity string in Mi, rounded up (readable, and never below ``n``)."""
    return f"{-(-n // MIB)}Mi"


def headroom(pool_bytes: int) -> int:
    """Sidecar memory beyond the pool (see the module doc for the why)."""
    return BASE_HEADROOM_BYTES + pool_bytes // INDEX_HEADROOM_DIVISOR


def size_pool(pool: PoolSpec, pool_bytes: int | None = None) -> Sizing:
    """Resources for a pool of ``pool_bytes`` (default: the policy's size)."""
    n = pool.size_bytes if pool_bytes is None else pool_bytes
    extra = headroom(n)
    if pool.hugepages:
        memory = mebibytes(extra)
        return Sizing(
            n,
            extra,
            {"cpu": SIDECAR_CPU_REQUEST, "memory": memory, "hugepages-2Mi": mebibytes(n)},
            {"memory": memory, "hugepages-2Mi": mebibytes(n)},
            "HugePages-2Mi",
            mebibytes(n),
        )
    memory = mebibytes(n + extra)
    return Sizing(
        n,
        extra,
        {"cpu": SIDECAR_CPU_REQUEST, "memory": memory},
        {"memory": memory},
        "Memory",
        mebibytes(n + EMPTYDIR_SLACK_BYTES),
    )
