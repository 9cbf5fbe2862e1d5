"""The pool's public types: its settings and every answer `Pool` gives (typed dataclasses the
servicer encodes; same fields as the proto messages they become)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvoffload_sidecar.keys import (
    NamespaceId,
    NamespaceSpec,
)
from kvoffload_sidecar.persist import Adoption
from kvoffload_sidecar.tenants import TenantsConfig, TenantStats

SLOT_BYTES_MULTIPLE = 16  # copy kernels move 16-byte vectors
MAX_SLOTS = (1 << 32) - 1  # slot ids are uint32 on the wire
MAX_CLIENT_NAME = 256
MAX_ID = (1 << 64) - 1
MAX_DEFERRED_TOUCHES = 8192  # keys whose policy touch may wait for `flush_deferred` (~0.2 ms)
DEFER_TOUCH_MIN = 256  # smaller hits are touched at once: queueing costs ~0.7 µs, touching 64 ~2


@dataclass(frozen=True)
class PoolSettings:
    """How the pool is built; the server fills it from its flags."""

    pool_size: int  # bytes, exactly the file size
    pool_dir: Path | None  # memory-backed directory shared with vLLM (None: a memfd backing)
    eviction: str = "lru"  # "lru" | "arc" | "package.module:Class"
    hugepages: bool = False  # pool_dir is hugetlbfs: pool_size must be a multiple of 2 MiB
    numa_node: int | None = None  # bind pre-faulted pages to this node (best effort)
    max_namespaces: int = 1  # equal partitions, one namespace each
    prefault_chunk_bytes: int = 64 << 20  # bytes touched per lock-free step of the pre-fault
    client_timeout_s: float = 60.0  # clients with no session and no call for this long are reaped
    # A client whose last session ended keeps its pins this long (capacity only: a load's
    # correctness rests on slot versions, a store's on its engine's file locks).
    detach_grace_s: float = 2.0
    # Accepted for deployed pod specs (--reserved-hold); no role: slots reserved when the last
    # sidecar died stay out until their engine is dead (engine_locks.py), however long.
    reserved_hold_s: float = 30.0
    prefault: bool = True  # False: sparse file, every slot ready at once. TEST/BENCH ONLY.
    tenants: TenantsConfig | None = None  # per-tenant quotas (tenants.py); None: off


@dataclass(frozen=True)
class RankRegion:
    """Slot i of this rank is bytes [offset + i*slot_bytes, offset + (i+1)*slot_bytes) of path."""

    rank: int
    path: str
    offset: int
    slot_bytes: int
    slot_count: int


@dataclass(frozen=True)
class Registration:
    namespace_id: NamespaceId
    client_id: int
    regions: tuple[RankRegion, ...]  # one per rank, rank order
    pool_ready: bool  # False while pre-faulting
    prefault_fraction: float  # 0..1
    committed_blocks: int  # blocks already visible (warm restart)
    pool_generation: str  # changes when the sidecar recreated the pool
    sidecar_epoch: int = 0  # random per sidecar process: commits name it (fencing)
    engine: int = 0  # the engine owning this client's store reservations
    engine_lock_base: int = 0  # lock byte of (engine e, rank r): base + (e << 8) + r
    slot_table_offset: int = 0  # the namespace's slot table in the pool file: state word of
    slot_record_bytes: int = 0  # slot i at offset + i * record_bytes (a slot's version)


@dataclass(frozen=True)
class LoadPin:
    """Pinned slots of the longest committed prefix; pin_id 0 and no slots when nothing hit."""

    pin_id: int
    slots: Sequence[int]  # a tuple, or an int array for batches above VECTOR_MIN
    # per slot, its version: the state word of its record (the commit's sequence number; 0
    # when the file cannot be read). A load that reads another word after its copy fails.
    versions: Sequence[int] = ()


class StoreDecision(enum.IntEnum):
    """Per-key answer of `reserve_store`; same numbers as the proto enum."""

    NEW = 1  # slot allocated: write it, then commit
    PRESENT = 2  # already committed or being stored: skip
    NO_SPACE = 3  # nothing allocatable: not stored


@dataclass(frozen=True)
class StoreReservation:
    store_id: int  # 0 when no key is NEW
    decisions: tuple[StoreDecision, ...]  # per key, in key order
    slots: Sequence[int]  # one per NEW key, in key order (an int array for large batches)


@dataclass(frozen=True)
class NamespaceStats:
    """Same fields as proto `NamespaceStats`."""

    namespace_id: NamespaceId
    spec: NamespaceSpec
    num_ranks: int
    slot_bytes: int  # per slot, all ranks together
    slot_count: int
    committed_slots: int
    reserved_slots: int
    pinned_slots: int
    live_clients: int
    capacity_bytes: int
    used_bytes: int
    pinned_bytes: int
    lookups: int
    hit_blocks: int
    miss_blocks: int
    stored_blocks: int
    loaded_blocks: int
    evicted_blocks: int
    stored_bytes: int
    loaded_bytes: int
    queried_blocks: int = 0  # keys asked by lookups (hit_blocks / queried_blocks: hit rate)
    tenants: tuple[TenantStats, ...] = ()  # per-tenant quotas (--tenants); () when off
    refused_commits: int = 0  # commits naming another sidecar instance or engine
    unlocked_reservations: int = 0  # store batches refused: an engine rank held no file lock
    withheld_slots: int = 0  # reserved under the last instance: free once its engine drained
    prefaulted_slots: int = 0  # slots [0, n) pre-faulted on every rank (the allocatable frontier)


@dataclass(frozen=True)
class PoolStats:
    pool_bytes: int
    prefaulted_bytes: int
    pool_ready: bool
    eviction_policy: str
    pool_generation: str
    namespaces: tuple[NamespaceStats, ...]
    uptime_seconds: float
    adoption: Adoption = field(default_factory=Adoption)  # what the start found in the file
