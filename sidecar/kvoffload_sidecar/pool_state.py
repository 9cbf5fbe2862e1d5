"""The pool's state under its lock: per namespace, client and engine (pool.py and its parts
read and change it; nothing outside the pool sees these)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvoffload_sidecar.allocator import FreeSlots
from kvoffload_sidecar.events import EventLog
from kvoffload_sidecar.index import SlotIndex
from kvoffload_sidecar.keys import (
    NamespaceId,
    NamespaceSpec,
)
from kvoffload_sidecar.persist import NamespaceLayout, SlotTable
from kvoffload_sidecar.policies import CachePolicy
from kvoffload_sidecar.pool_types import RankRegion
from kvoffload_sidecar.tenants import TenantPolicy


@dataclass(slots=True)
class Counters:
    lookups: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    queried_blocks: int = 0
    stored_blocks: int = 0
    loaded_blocks: int = 0
    evicted_blocks: int = 0
    refused_commits: int = 0
    unlocked_reservations: int = 0


@dataclass(slots=True)
class ClientState:
    client_id: int
    name: str
    namespace_id: NamespaceId
    last_seen: float
    engine: int  # the engine its store reservations belong to
    sessions: int = 0
    detached_at: float | None = None  # its last session ended then: reaped after the grace
    pins: set[int] = field(default_factory=set)


@dataclass(slots=True)
class EngineState:
    """One vLLM instance's store reservations: they outlive its sessions and are reused only
    after a commit, an abort by it, or its death (no rank holds its file lock)."""

    engine: int
    armed: bool = False  # every rank held its lock at a probe since the last death check
    stores: set[int] = field(default_factory=set)


@dataclass(slots=True)
class NamespaceState:
    namespace_id: NamespaceId
    spec: NamespaceSpec
    num_ranks: int
    slot_bytes_per_rank: int
    partition: int
    regions: tuple[RankRegion, ...]
    index: SlotIndex
    free: FreeSlots
    policy: CachePolicy
    last_used: float
    layout: NamespaceLayout
    table: SlotTable  # the slot records in the pool file (persist.py)
    withheld: np.ndarray = field(default_factory=lambda: np.zeros(0, np.intp))  # slots reserved
    # when the last sidecar died: free once their owner (same position below) is dead
    withheld_owners: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    engines: dict[int, EngineState] = field(default_factory=dict)  # engines with open stores
    # per engine, the ranks that reported no copy in flight into another instance's
    # reservations (`report_drained`); its withheld slots free once every rank has
    drained: dict[int, set[int]] = field(default_factory=dict)
    clients: set[int] = field(default_factory=set)
    counters: Counters = field(default_factory=Counters)
    touches: list[bytes] = field(default_factory=list)  # deferred, packed keys, in call order
    touched: int = 0  # keys in `touches`
    events: EventLog | None = None  # set at creation: blocks in and out, for KV events
    tenants: TenantPolicy | None = None  # `policy` itself when --tenants is set (tenants.py)

    @property
    def slot_count(self) -> int:
        return self.index.slot_count

    @property
    def slot_bytes(self) -> int:
        return self.slot_bytes_per_rank * self.num_ranks


def slot_list(slots: Sequence[int] | np.ndarray) -> list[int]:
    return slots.tolist() if isinstance(slots, np.ndarray) else list(slots)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
