"""`Pool`: the sidecar's domain API, composed of region, index, allocator and policy.

The gRPC servicer decodes a request, calls one `Pool` method and encodes the answer; domain
errors (`kvoffload_sidecar.errors`) become status codes in one table there. Nothing here imports
grpc. KV bytes never pass through the pool: it only decides which slot holds which key and when a
slot may be read, written or reused (docs/ARCHITECTURE.md, Contract 1).

Thread contract: every public method takes `self._lock` (one lock) for its whole body; the
pre-fault thread takes it briefly after each chunk to advance the allocatable frontier.
"""

from __future__ import annotations

import enum
import logging
import secrets
import threading
import time
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field, replace
from itertools import compress, repeat
from operator import is_
from pathlib import Path

import numpy as np

from kvoffload_sidecar import allocator, persist
from kvoffload_sidecar.allocator import FreeSlots
from kvoffload_sidecar.engine_locks import (
    GEN_SPAN,
    LOCK_BASE,
    LOCK_END,
    MAX_ENGINE,
    FileLocks,
    Liveness,
    engine_offset,
    generation_base,
)
from kvoffload_sidecar.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvoffload_sidecar.events import EventLog, EventPage, check_announce
from kvoffload_sidecar.index import SlotIndex, Slots, SlotState, StoreRecord
from kvoffload_sidecar.keys import (
    MAX_KEYS_PER_CALL,
    NamespaceId,
    NamespaceSpec,
    PoolKey,
    check_packed,
    derive_namespace,
    split_keys,
)
from kvoffload_sidecar.persist import Adoption, NamespaceLayout, SlotTable
from kvoffload_sidecar.policies import CachePolicy, make_policy
from kvoffload_sidecar.policies.base import consume
from kvoffload_sidecar.policies.factory import resolve_policy
from kvoffload_sidecar.presence import PresenceMap
from kvoffload_sidecar.region import PrefaultGate, Region
from kvoffload_sidecar.tenants import KeySalts, TenantPolicy, TenantsConfig, TenantStats

__all__ = [
    "LoadPin",
    "NamespaceStats",
    "Pool",
    "PoolSettings",
    "PoolStats",
    "RankRegion",
    "Registration",
    "StoreDecision",
    "StoreReservation",
]

log = logging.getLogger(__name__)

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
    pool_dir: Path  # memory-backed directory shared with the vLLM container
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


_NEW, _PRESENT, _NO_SPACE = StoreDecision.NEW, StoreDecision.PRESENT, StoreDecision.NO_SPACE


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


@dataclass(slots=True)
class _Counters:
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
class _Client:
    client_id: int
    name: str
    namespace_id: NamespaceId
    last_seen: float
    engine: int  # the engine its store reservations belong to
    sessions: int = 0
    detached_at: float | None = None  # its last session ended then: reaped after the grace
    pins: set[int] = field(default_factory=set)


@dataclass(slots=True)
class _Engine:
    """One vLLM instance's store reservations: they outlive its sessions and are reused only
    after a commit, an abort by it, or its death (no rank holds its file lock)."""

    engine: int
    armed: bool = False  # every rank held its lock at a probe since the last death check
    stores: set[int] = field(default_factory=set)


@dataclass(slots=True)
class _Namespace:
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
    engines: dict[int, _Engine] = field(default_factory=dict)  # engines with open stores
    # per engine, the ranks that reported no copy in flight into another instance's
    # reservations (`report_drained`); its withheld slots free once every rank has
    drained: dict[int, set[int]] = field(default_factory=dict)
    clients: set[int] = field(default_factory=set)
    counters: _Counters = field(default_factory=_Counters)
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


class _Protected:
    """`protected` for `CachePolicy.evict`: pinned keys and the keys of the current request."""

    __slots__ = ("_index", "_request")

    def __init__(self, index: SlotIndex, request: set[PoolKey]) -> None:
        self._index = index
        self._request = request

    def __contains__(self, key: object) -> bool:
        return key in self._request or self._index.is_pinned_key(key)


class Pool:
    """The host-memory KV pool: namespaces, partitions, clients, slots.

    Thread-safe: every public method takes `self._lock` (one lock; the pre-fault thread takes it
    briefly per chunk). Bad input raises a `PoolError` subclass and changes nothing.
    """

    def __init__(
        self,
        settings: PoolSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        prefault_gate: PrefaultGate | None = None,
        liveness: Liveness | None = None,
    ) -> None:
        """`liveness(start, length)`: whether some process holds a lock on those bytes of the
        pool file (engine_locks.py); default: `F_OFD_GETLK` on the pool file itself."""
        s = settings
        if not isinstance(s.max_namespaces, int) or not 1 <= s.max_namespaces <= 1024:
            raise ValueError(f"max_namespaces must be in 1..1024, got {s.max_namespaces!r}")
        if not s.client_timeout_s > 0:
            raise ValueError(f"client_timeout_s must be > 0, got {s.client_timeout_s!r}")
        if not s.detach_grace_s >= 0:
            raise ValueError(f"detach_grace_s must be >= 0, got {s.detach_grace_s!r}")
        resolve_policy(s.eviction)  # ValueError naming the choices
        self.settings = s
        self._clock = clock
        self._lock = threading.Lock()
        self._region = Region(
            Path(s.pool_dir),
            s.pool_size,
            lock=self._lock,
            chunk_bytes=s.prefault_chunk_bytes,
            hugepages=s.hugepages,
            numa_node=s.numa_node,
            prefault=s.prefault,
            gate=prefault_gate,
            on_progress=self._on_prefault_progress,
        )
        self._geometry = persist.geometry(s.pool_size, s.max_namespaces, s.hugepages)
        self._partitions: list[NamespaceId | None] = [None] * s.max_namespaces
        self._namespaces: dict[NamespaceId, _Namespace] = {}
        self._clients: dict[int, _Client] = {}
        # Ids start at a random base per process: a connector's late call with an id of the
        # sidecar instance before (a store commit, a pin release) can never name one of ours.
        self._next_client = self._id_base()
        self._next_pin = self._id_base()
        self._next_store = self._id_base()
        self._presence: PresenceMap | None = None  # attach_presence
        self._commit_seq = persist.FIRST_SEQ  # next commit record's sequence number
        self._evict_from = 0.0  # clock time before which adopted blocks are not evicted
        self._tenant_codes_valid = True  # the file's tenant codes index this --tenants
        self._liveness: Liveness = liveness or FileLocks(lambda: self._region._fd)
        # Random per process: a commit names the instance that answered its reservation, so a
        # late commit meant for a dead instance can never make another store visible here.
        self.epoch = secrets.randbits(63) | 1
        # False after the file's contents were discarded (or rebuilt): stores wait until no
        # engine lock is held outside this generation's range (every earlier writer drained)
        self._writers_clear = True
        self.adoption = Adoption()
        self._draining = False
        self._deferred = False  # some namespace may have queued touches (`flush_deferred`)
        self._started = False
        self._started_at = clock()
        self.generation = secrets.token_hex(8)
        self.lock_base = generation_base(self.generation)
        self.rebuilds = 0  # times the pool file was rebuilt after it changed under us
        self._ready_event = threading.Event()

    @staticmethod
    def _now_ms() -> int:
        return int(time.time() * 1e3)

    @staticmethod
    def _id_base() -> int:
        return (secrets.randbits(30) << 32) | 1

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def path(self) -> Path:
        return self._region.path

    @property
    def region(self) -> Region:
        return self._region

    def start(self) -> None:
        """Create and size the pool file, start the pre-fault (OSError/ValueError if unusable)."""
        with self._lock:
            if self._started:
                return
            self._region.open()
            self._started = True
            self._started_at = self._clock()
            self._open_index()
        self._region.start_prefault()
        with self._lock:
            self._on_prefault_progress()
        log.info(
            "pool %s: %d bytes at %s, %d partition(s), eviction %s",
            self.generation,
            self.settings.pool_size,
            self.path,
            self.settings.max_namespaces,
            self.settings.eviction,
        )

    def _open_index(self) -> None:
        """Lock held, file mapped: adopt the index the sidecar before us left in the file
        (persist.py), or start a new one. Sets `generation` and `adoption`."""
        t0 = time.perf_counter()
        region, geom = self._region, self._geometry
        buf = region.buffer
        found = persist.read_header(buf, geom) if region.reused else None
        grace = self.settings.detach_grace_s
        tenants = self.settings.tenants
        # the codes index tenant names in order: shares and salts may change, names may not
        digest = persist.tenants_digest("\n".join(tenants.names) if tenants is not None else None)
        if found is not None and found.problem is None:
            self.generation = found.generation
            self.lock_base = generation_base(self.generation)
            adoption = Adoption("adopted", "", found.format_version, boots=found.boots + 1)
            persist.count_boot(buf, geom, adoption.boots)
            # the records' tenant codes index the --tenants recorded here: another one (or none)
            # means they say nothing of this one's tenants
            self._tenant_codes_valid = persist.read_tenants(buf, geom) == digest
            for partition in range(geom.max_namespaces):
                layout = persist.read_namespace(buf, geom, partition, self.generation)
                if isinstance(layout, str):
                    log.warning("partition %d: namespace not adopted: %s", partition, layout)
                    adoption.add_discards({"namespace": 1})
                elif layout is not None:
                    self._adopt_namespace(layout, adoption)
            # Slots reserved at death stay withheld until their engine is dead. Loads of the
            # dead instance's pins check their slots' versions; sparing adopted blocks from
            # eviction for the grace only keeps those loads from failing needlessly.
            self._evict_from = self._started_at + grace
        else:
            if found is None:
                adoption = Adoption("new", "no pool file was left: created one")
            else:
                adoption = Adoption("discarded", found.problem or "", found.format_version)
                # Workers of the file's earlier contents may still copy into it: no slot goes
                # to a store until none holds a lock outside the new generation's range.
                self._writers_clear = False
            self._new_generation()
            persist.write_header(buf, geom, self.generation)
        persist.write_tenants(buf, geom, digest)  # the adopted records now agree with it
        adoption.seconds = time.perf_counter() - t0
        self.adoption = adoption
        if adoption.outcome == "adopted":
            log.warning(
                "adopted the pool file %s (boot %d, generation %s): %d committed blocks in %d "
                "namespace(s) in %.3f s; not adopted: %s",
                self.path,
                adoption.boots,
                self.generation,
                adoption.adopted_blocks,
                adoption.adopted_namespaces,
                adoption.seconds,
                adoption.discarded or "none",
            )
        elif adoption.outcome == "discarded":
            log.warning(
                "discarded the contents of the pool file %s: %s; stores start once the "
                "workers of its earlier contents drained or exited",
                self.path,
                adoption.reason,
            )

    def _new_generation(self) -> None:
        """Lock held: a fresh generation whose engine-lock range nobody holds (so every lock
        outside it is an earlier generation's writer)."""
        while True:
            self.generation = secrets.token_hex(8)
            self.lock_base = generation_base(self.generation)
            if not self._liveness(self.lock_base, GEN_SPAN):
                return

    def _earlier_writers(self) -> bool:
        """Lock held: some worker still holds an engine lock of another generation (it may
        still copy into this file's slots)."""
        if self._writers_clear:
            return False
        base, end = self.lock_base, self.lock_base + GEN_SPAN
        if self._liveness(LOCK_BASE, base - LOCK_BASE) or self._liveness(end, LOCK_END - end):
            return True
        self._writers_clear = True
        log.info("no worker of the pool file's earlier contents is left: stores start")
        return False

    def _adopt_namespace(self, layout: NamespaceLayout, adoption: Adoption) -> None:
        """Lock held: a namespace read back from the file, with its committed blocks."""
        table = SlotTable(self._region.buffer, layout)
        scan = table.scan()
        withheld = scan.withheld  # until each slot's owner is dead (`_reclaim_dead_engines`)
        spec = layout.spec
        index = SlotIndex(layout.slot_count, layout.num_ranks, spec.key_size)
        index.adopt(scan.packed, scan.slots)
        policy = self._new_policy(layout.slot_count)
        n = len(scan.slots)
        adopted = split_keys(scan.packed, spec.key_size, max_keys=max(n, 1))
        insert_many = getattr(policy, "insert_many", None)  # optional: LRU has a C-speed one
        if not self._tenant_codes_valid and scan.tenants.any():
            table.forget_tenants(scan.slots)  # they indexed another --tenants: default now
            scan.tenants[:] = 0
        if isinstance(policy, TenantPolicy):  # each block back to the tenant that stored it
            policy.adopt(adopted, scan.tenants.tolist())
        elif insert_many is not None:
            insert_many(adopted)
        else:
            consume(map(policy.insert, adopted))
        ns = _Namespace(
            namespace_id=layout.namespace_id,
            spec=spec,
            num_ranks=layout.num_ranks,
            slot_bytes_per_rank=layout.slot_bytes_per_rank,
            partition=layout.partition,
            regions=self._regions_of(layout),
            index=index,
            free=FreeSlots.adopted(layout.slot_count, scan.slots, withheld),
            policy=policy,
            last_used=self._clock(),
            layout=layout,
            table=table,
            withheld=withheld,
            withheld_owners=scan.withheld_owners,
            events=EventLog(layout.slot_count, self._clock),
            tenants=policy if isinstance(policy, TenantPolicy) else None,
        )
        self._partitions[layout.partition] = ns.namespace_id
        self._namespaces[ns.namespace_id] = ns
        self._commit_seq = max(self._commit_seq, scan.max_seq + 1)
        adoption.adopted_blocks += n
        adoption.adopted_namespaces += 1
        adoption.add_discards(scan.discarded)
        self._set_prefault_priority()
        self._update_ready(ns)

    def _regions_of(self, layout: NamespaceLayout) -> tuple[RankRegion, ...]:
        path = str(self.path)
        return tuple(
            RankRegion(
                r, path, layout.rank_offset(r), layout.slot_bytes_per_rank, layout.slot_count
            )
            for r in range(layout.num_ranks)
        )

    def close(self, *, remove: bool = False) -> None:
        """Stop the pre-fault and unmap; the pool is unusable afterwards. The file stays (the
        next sidecar of the pod adopts it) unless `remove`."""
        with self._lock:
            self._namespaces.clear()  # their slot tables are views of the mapping
            self._clients.clear()
            if self._presence is not None:  # connectors still mapping it keep their copy
                self._presence.close()
                self._presence = None
            self._partitions = [None] * len(self._partitions)
        self._region.close(remove=remove)
        with self._lock:
            self._started = False
            self._draining = True

    def check_file(self) -> bool:
        """The reaper tick: when the pool file was truncated, removed or replaced under us,
        rebuild the pool in place (file sized and pre-faulted again, a new generation, every
        namespace and client forgotten: the contents are gone). True when it rebuilt; the
        caller then ends every session, so the connectors register again and re-map."""
        with self._lock:
            if not self._started or self._draining:
                return False
            problem = self._region.file_problem()
        if problem is None:
            return False
        self._region.stop_prefault()  # before re-sizing: it must not touch a short file
        with self._lock:
            if not self._started or self._draining:
                return False
            old = self.generation
            for ns in list(self._namespaces.values()):
                self._drop_namespace(ns)
            self._ready_event.clear()
            # Copies a connector still had in flight may land in the file: stores wait until
            # no worker holds a lock of the old generation (each drains before it re-maps).
            self._new_generation()
            self._writers_clear = False
            self.rebuilds += 1
            self._evict_from = 0.0
            try:
                self._region.rebuild()
                persist.write_header(self._region.buffer, self._geometry, self.generation)
            except (OSError, ValueError) as exc:
                self._started = False  # every call answers FAILED_PRECONDITION from now on
                log.error(
                    "the pool file %s %s and cannot be rebuilt (%s): serving without a pool",
                    self.path,
                    problem,
                    exc,
                )
                return True
        log.warning(
            "the pool file %s %s under the sidecar: rebuilt it (generation %s -> %s), its "
            "contents are gone; connectors register again",
            self.path,
            problem,
            old,
            self.generation,
        )
        self._region.start_prefault()
        with self._lock:
            self._on_prefault_progress()
        return True

    def open_stores(self) -> int:
        """Store reservations not yet committed or aborted (all namespaces)."""
        with self._lock:
            return sum(len(ns.index.stores) for ns in self._namespaces.values())

    def begin_drain(self) -> None:
        """Refuse new registrations and reservations (Unavailable); commits/releases still work."""
        with self._lock:
            self._draining = True

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the pre-fault finished; False on timeout."""
        return self._ready_event.wait(timeout)

    def _on_prefault_progress(self) -> None:
        """Lock held: move every namespace's allocatable frontier to the pre-faulted bytes."""
        for ns in self._namespaces.values():
            self._update_ready(ns)
        if self._region.done:
            self._ready_event.set()

    def _update_ready(self, ns: _Namespace) -> None:
        if ns.free.ready >= ns.slot_count:
            return
        ready = ns.slot_count
        for r in ns.regions:
            got = self._region.ready_prefix(r.offset, r.slot_count * r.slot_bytes)
            ready = min(ready, got // r.slot_bytes)
        ns.free.set_ready(ready)

    def _set_prefault_priority(self) -> None:
        ranges = [
            (r.offset, r.slot_count * r.slot_bytes)
            for ns in self._namespaces.values()
            for r in ns.regions
        ]
        self._region.set_priority(ranges)

    # -- registration and clients -------------------------------------------------------------

    def register(
        self,
        spec: NamespaceSpec,
        num_ranks: int,
        slot_bytes_per_rank: int,
        client_name: str,
        engine: int = 0,
    ) -> Registration:
        """Attach an engine process to the namespace of `spec`, creating it on first use.
        `engine`: the key (1 .. MAX_ENGINE - 1) of the vLLM instance the process belongs to;
        its store reservations belong to that engine and outlive this client (engine_locks.py).
        0: the client is an engine of its own, with a key derived from its id."""
        if not isinstance(spec, NamespaceSpec):
            raise InvalidArgument("spec must be a NamespaceSpec")
        namespace_id = derive_namespace(spec)  # validates the spec
        if not _is_int(num_ranks) or not 1 <= num_ranks <= 64:
            raise InvalidArgument(f"num_ranks must be in 1..64, got {num_ranks!r}")
        if num_ranks != spec.tp_size:
            raise InvalidArgument(f"num_ranks {num_ranks} differs from spec.tp_size {spec.tp_size}")
        if (
            not _is_int(slot_bytes_per_rank)
            or slot_bytes_per_rank < 1
            or slot_bytes_per_rank % SLOT_BYTES_MULTIPLE
        ):
            raise InvalidArgument(
                f"slot_bytes_per_rank must be a positive multiple of {SLOT_BYTES_MULTIPLE}, "
                f"got {slot_bytes_per_rank!r}"
            )
        if not isinstance(client_name, str) or len(client_name) > MAX_CLIENT_NAME:
            raise InvalidArgument(f"client_name must be a string of at most {MAX_CLIENT_NAME}")
        if not _is_int(engine) or not 0 <= engine < MAX_ENGINE:
            raise InvalidArgument(f"engine must be in 0..{MAX_ENGINE - 1}, got {engine!r}")
        with self._lock:
            self._check_serving()
            if not self._region.intact():
                raise Unavailable("the pool file changed under the sidecar; it is being rebuilt")
            now = self._clock()
            ns = self._namespaces.get(namespace_id)
            if ns is not None:
                if (ns.num_ranks, ns.slot_bytes_per_rank) != (num_ranks, slot_bytes_per_rank):
                    raise FailedPrecondition(
                        f"namespace {namespace_id} is registered with {ns.num_ranks} ranks of "
                        f"{ns.slot_bytes_per_rank} slot bytes, not {num_ranks} of "
                        f"{slot_bytes_per_rank}"
                    )
            else:
                ns = self._create_namespace(namespace_id, spec, num_ranks, slot_bytes_per_rank, now)
            client_id = self._next_client
            key = engine or client_id % (MAX_ENGINE - 1) + 1
            client = _Client(client_id, client_name, namespace_id, last_seen=now, engine=key)
            self._next_client += 1
            self._clients[client.client_id] = client
            ns.clients.add(client.client_id)
            ns.last_used = now
            region = self._region
            return Registration(
                namespace_id=namespace_id,
                client_id=client.client_id,
                regions=ns.regions,
                pool_ready=region.done,
                prefault_fraction=region.prefaulted_bytes / region.size,
                committed_blocks=ns.index.counts.committed,
                pool_generation=self.generation,
                sidecar_epoch=self.epoch,
                engine=key,
                engine_lock_base=self.lock_base,
                slot_table_offset=ns.layout.table_offset,
                slot_record_bytes=ns.layout.record_bytes,
            )

    def _create_namespace(
        self,
        namespace_id: NamespaceId,
        spec: NamespaceSpec,
        num_ranks: int,
        slot_bytes_per_rank: int,
        now: float,
    ) -> _Namespace:
        geom = self._geometry
        if persist.plan_namespace(geom, 0, spec, num_ranks, slot_bytes_per_rank) is None:
            raise ResourceExhausted(
                f"a partition of {geom.partition_bytes} bytes holds no slot of {num_ranks} x "
                f"{slot_bytes_per_rank} bytes (each rank's region is aligned to {geom.align} "
                "bytes, and the partition keeps its slot table)"
            )
        partition = self._take_partition(now)
        layout = persist.plan_namespace(geom, partition, spec, num_ranks, slot_bytes_per_rank)
        assert layout is not None  # every partition has the same size
        slot_count = layout.slot_count
        table = persist.write_namespace(self._region.buffer, layout, self.generation)
        ns = _Namespace(
            namespace_id=namespace_id,
            spec=spec,
            num_ranks=num_ranks,
            slot_bytes_per_rank=slot_bytes_per_rank,
            partition=partition,
            regions=self._regions_of(layout),
            index=SlotIndex(slot_count, num_ranks, spec.key_size),
            free=FreeSlots(slot_count),
            policy=self._new_policy(slot_count),
            last_used=now,
            layout=layout,
            table=table,
            events=EventLog(slot_count, self._clock),
        )
        if isinstance(ns.policy, TenantPolicy):
            ns.tenants = ns.policy
        self._partitions[partition] = namespace_id
        self._namespaces[namespace_id] = ns
        self._set_prefault_priority()
        self._update_ready(ns)
        log.info(
            "namespace %s (%s) in partition %d: %d ranks x %d slots of %d bytes",
            namespace_id,
            spec.model,
            partition,
            num_ranks,
            slot_count,
            slot_bytes_per_rank,
        )
        return ns

    def _new_policy(self, slot_count: int) -> CachePolicy:
        """A namespace's eviction policy: per-tenant quotas over one policy per tenant when
        --tenants is set, else one."""
        tenants = self.settings.tenants
        if tenants is None:
            return make_policy(self.settings.eviction, slot_count)
        return TenantPolicy(tenants, self.settings.eviction, slot_count)

    def _take_partition(self, now: float) -> int:
        for i, owner in enumerate(self._partitions):
            if owner is None:
                return i
        idle = [  # a namespace whose engines may still write its slots is not idle
            ns
            for ns in self._namespaces.values()
            if not any(self._is_live(self._clients[c], now) for c in ns.clients)
            and not ns.index.stores
            and not len(ns.withheld)
        ]
        if not idle:
            raise ResourceExhausted(
                f"all {len(self._partitions)} partitions belong to namespaces with live clients"
            )
        victim = min(idle, key=lambda n: n.last_used)
        self._drop_namespace(victim)
        log.info(
            "reclaimed partition %d from idle namespace %s (%d committed blocks dropped)",
            victim.partition,
            victim.namespace_id,
            victim.index.counts.committed,
        )
        return victim.partition

    def _drop_namespace(self, ns: _Namespace) -> None:
        for cid in ns.clients:
            del self._clients[cid]
        del self._namespaces[ns.namespace_id]
        self._partitions[ns.partition] = None
        self._set_prefault_priority()

    def attach(self, client_id: int) -> None:
        """A session stream opened for this client: it stays live until `detach`."""
        with self._lock:
            client = self._client(client_id)
            client.sessions += 1
            client.last_seen = self._clock()
            client.detached_at = None

    def detach(self, client_id: int) -> None:
        """A session ended. When it was the client's last one: after `detach_grace_s` (at once
        when 0) release its pins and forget it (NotFound if unknown). Its store reservations
        stay with its engine: a client of the same engine that registers again finishes them,
        and they are reclaimed only once the engine is dead (`_reclaim_dead_engines`)."""
        with self._lock:
            client = self._client(client_id)
            client.sessions = max(0, client.sessions - 1)
            if client.sessions == 0:
                if self.settings.detach_grace_s > 0:
                    client.detached_at = self._clock()
                else:
                    self._forget_client(client)

    def reap_idle_clients(self) -> int:
        """Forget clients detached for `detach_grace_s`, or with no session and no call for
        `client_timeout_s`, and reclaim the reservations of dead engines; returns how many
        clients were forgotten."""
        with self._lock:
            now = self._clock()
            if self._evict_from and now >= self._evict_from:
                self._evict_from = 0.0
            idle = [c for c in self._clients.values() if not self._is_live(c, now)]
            for client in idle:
                log.info("reaping idle client %d (%s)", client.client_id, client.name)
                self._forget_client(client)
            self._reclaim_dead_engines()
            return len(idle)

    def reclaim_dead_engines(self) -> int:
        """Probe every engine with open reservations (and the owners of slots withheld since
        adoption): those no rank holds a lock for are dead, and their slots free. Returns the
        slots freed. The reaper calls it each tick."""
        with self._lock:
            return self._reclaim_dead_engines()

    def report_drained(
        self, namespace_id: str, client_id: int, *, epoch: int, engine: int, rank: int
    ) -> int:
        """Rank `rank` of `engine`, over its registration with this instance (`epoch`), has no
        copy in flight into a reservation another sidecar instance answered and starts none
        from now on. Once every rank of the engine reported, the slots withheld at adoption
        for it are free (no process of it may still write them). Returns the slots freed."""
        with self._lock:
            ns = self._namespace(namespace_id)
            self._owned_client(ns, client_id)
            if not _is_int(epoch) or epoch != self.epoch:
                raise FailedPrecondition(
                    f"drained report names sidecar instance {epoch!r}, this is {self.epoch:#x}"
                )
            if not _is_int(engine) or not 0 < engine < MAX_ENGINE:
                raise InvalidArgument(f"engine must be in 1..{MAX_ENGINE - 1}, got {engine!r}")
            if not _is_int(rank) or not 0 <= rank < ns.num_ranks:
                raise InvalidArgument(f"rank must be in 0..{ns.num_ranks - 1}, got {rank!r}")
            ranks = ns.drained.setdefault(engine, set())
            ranks.add(rank)
            if len(ranks) < ns.num_ranks or not len(ns.withheld):
                return 0
            return self._free_withheld(ns, ns.withheld_owners == engine)

    def _free_withheld(self, ns: _Namespace, gone: np.ndarray) -> int:
        """Lock held: the withheld slots where `gone` is set are free (file table, free list)."""
        slots = ns.withheld[gone]
        if not len(slots):
            return 0
        if self._region.intact():
            ns.table.mark(slots, persist.FREE)
        ns.free.release_many(slots)
        ns.withheld, ns.withheld_owners = ns.withheld[~gone], ns.withheld_owners[~gone]
        log.info(
            "namespace %s: %d withheld slot(s) free (their engines drained or died)",
            ns.namespace_id,
            len(slots),
        )
        return len(slots)

    def _engine_alive(self, ns: _Namespace, engine: int) -> bool:
        """Lock held: some rank of `engine` holds its lock (it may still write)."""
        if not 0 < engine < MAX_ENGINE:  # not a key a worker can lock: nobody writes for it
            return False
        return self._liveness(engine_offset(self.lock_base, engine), ns.num_ranks)

    def _engine_armed(self, ns: _Namespace, engine: int) -> bool:
        """Lock held: every rank of `engine` holds its lock, so any process that may write its
        reservations' slots is seen by the death probe. Remembered until it dies."""
        record = ns.engines.get(engine)
        if record is not None and record.armed:
            return True
        base = self.lock_base
        if not all(self._liveness(engine_offset(base, engine, r), 1) for r in range(ns.num_ranks)):
            return False
        if record is None:
            record = ns.engines[engine] = _Engine(engine)
        record.armed = True
        return True

    def _reclaim_dead_engines(self) -> int:
        """Lock held: `reclaim_dead_engines`."""
        freed = 0
        for ns in self._namespaces.values():
            for engine, record in list(ns.engines.items()):
                if self._engine_alive(ns, engine):
                    continue
                for store_id in list(record.stores):
                    freed += len(self._abort(ns, store_id)[1])
                if record.stores or record.armed:
                    log.info("engine %d of namespace %s is gone: its reservations are free",
                             engine, ns.namespace_id)  # fmt: skip
                del ns.engines[engine]
            if len(ns.withheld):
                owners = ns.withheld_owners
                dead = [o for o in np.unique(owners).tolist() if not self._engine_alive(ns, o)]
                if dead:
                    freed += self._free_withheld(ns, np.isin(owners, np.asarray(dead, np.uint64)))
        return freed

    def _record_use(self, ns: _Namespace, slots: Sequence[int] | np.ndarray) -> None:
        """Lock held: hit slots' last use in the file, so an adopter keeps the LRU order."""
        if self._region.intact():
            ns.table.touch(slots, self._commit_seq)
            self._commit_seq += 1

    def _mark_free(self, ns: _Namespace, slots: Sequence[int] | np.ndarray) -> None:
        """Lock held: aborted store slots are free in the file's table too."""
        if self._region.intact():
            ns.table.mark(slots, persist.FREE)

    def _is_live(self, client: _Client, now: float) -> bool:
        if client.sessions > 0:
            return True
        if client.detached_at is not None:
            return now - client.detached_at < self.settings.detach_grace_s
        return now - client.last_seen < self.settings.client_timeout_s

    def _forget_client(self, client: _Client) -> None:
        """Lock held: its pins go; its store reservations stay with its engine."""
        ns = self._namespaces[client.namespace_id]
        for pin_id in client.pins:
            ns.index.unpin(pin_id)
        ns.clients.discard(client.client_id)
        del self._clients[client.client_id]

    # -- block operations ---------------------------------------------------------------------

    def lookup(
        self, namespace_id: str, queries: Sequence[bytes], salts: Sequence[str] | None = None
    ) -> list[int]:
        """Per query (packed keys): length of the longest committed prefix. Touches the hits.
        `salts`: per query, its request's cache salt (per-tenant counts with --tenants)."""
        with self._lock:
            ns = self._namespace(namespace_id)
            checked = self._check_queries(ns, queries)
            index = ns.index
            hits: list[int] = []
            for packed, _ in checked:
                slots = index.committed_prefix_packed(packed)
                n = len(slots)
                hits.append(n)
                if n:
                    self._touch_packed(ns, packed, n)
                    self._record_use(ns, slots)
            self._count_lookups(ns, checked, hits, salts)
            return hits

    def count_misses(
        self, namespace_id: str, queries: Sequence[bytes], salts: Sequence[str] | None = None
    ) -> list[int]:
        """Count queries a client answered as misses itself (its presence map) as lookups
        that found nothing, as `lookup` would have then; nothing is looked up or touched now
        (a block stored since would count as a hit and move up the eviction order)."""
        with self._lock:
            ns = self._namespace(namespace_id)
            checked = self._check_queries(ns, queries)
            hits = [0] * len(checked)
            self._count_lookups(ns, checked, hits, salts)
            return hits

    def _count_lookups(
        self,
        ns: _Namespace,
        checked: list[tuple[bytes, int]],
        hits: list[int],
        salts: Sequence[str] | None,
    ) -> None:
        """Lock held: the lookup counters (per namespace and tenant) of answered queries."""
        counters = ns.counters
        for hit, (_, n_keys) in zip(hits, checked, strict=True):
            counters.hit_blocks += hit
            counters.queried_blocks += n_keys
            if hit < n_keys:
                counters.miss_blocks += 1
        counters.lookups += len(checked)
        if ns.tenants is not None:
            for i, (hit, (_, n_keys)) in enumerate(zip(hits, checked, strict=True)):
                salt = salts[i] if salts is not None and i < len(salts) else None
                ns.tenants.count_lookup(salt, hit, n_keys)
        ns.last_used = self._clock()

    def reserve_load(
        self,
        namespace_id: str,
        client_id: int,
        keys: bytes,
        *,
        count_lookup: bool = False,
        cache_salt: str = "",
    ) -> LoadPin:
        """Pin the longest committed prefix of `keys` for reading until `release`;
        `count_lookup`: also count it as a lookup of `keys` (a lookup and pin in one call), for
        the tenant of `cache_salt` too (--tenants)."""
        with self._lock:
            self._check_serving()
            ns = self._namespace(namespace_id)
            client = self._owned_client(ns, client_id)
            packed, n_keys = check_packed(keys, ns.spec.key_size)
            pin_id = self._next_pin
            record = ns.index.pin_prefix_packed(pin_id, client.client_id, packed)
            if count_lookup:
                n = len(record.slots) if record is not None else 0
                ns.counters.lookups += 1
                ns.counters.hit_blocks += n
                ns.counters.miss_blocks += n < n_keys
                ns.counters.queried_blocks += n_keys
                ns.last_used = self._clock()
                if ns.tenants is not None:
                    ns.tenants.count_lookup(cache_salt, n, n_keys)
            if record is None:
                return LoadPin(0, ())
            self._next_pin += 1
            client.pins.add(pin_id)
            n = len(record.slots)
            self._touch_packed(ns, packed, n)
            self._record_use(ns, record.slots)
            ns.counters.loaded_blocks += n
            return LoadPin(pin_id, record.slots, self._versions(ns, record.slots))

    def _versions(self, ns: _Namespace, slots: Sequence[int] | np.ndarray) -> Sequence[int]:
        """Lock held: the committed slots' versions (their records' state words); zeros, which
        no load accepts, when the file cannot be read."""
        if not self._region.intact():
            return np.zeros(len(slots), np.uint64)
        if isinstance(slots, np.ndarray):
            return ns.table.versions(slots)
        state = ns.table.state
        return tuple(int(state[slot]) for slot in slots)

    def release(self, namespace_id: str, client_id: int, pin_ids: Sequence[int]) -> int:
        """Drop pins taken by `reserve_load`; all or nothing. Returns the slots released."""
        with self._lock:
            ns = self._namespace(namespace_id)
            client = self._owned_client(ns, client_id)
            if isinstance(pin_ids, (bytes, str)):
                raise InvalidArgument("pin_ids must be a sequence of integers")
            ids = list(pin_ids)
            if len(ids) > MAX_KEYS_PER_CALL:
                raise InvalidArgument(
                    f"{len(ids)} pin ids in one release, at most {MAX_KEYS_PER_CALL}"
                )
            for pin_id in ids:
                self._check_id(pin_id, "pin id")
            if len(set(ids)) != len(ids):
                raise InvalidArgument("pin ids repeat in one release")
            for pin_id in ids:
                if pin_id not in client.pins:
                    raise NotFound(f"pin {pin_id} is unknown or not client {client_id}'s")
            released = 0
            for pin_id in ids:
                released += ns.index.unpin(pin_id)
                client.pins.discard(pin_id)
            return released

    def reserve_store(
        self,
        namespace_id: str,
        client_id: int,
        keys: bytes,
        announce: Sequence[bytes] = (),
        salts: KeySalts | None = None,
    ) -> StoreReservation:
        """Per key in order: PRESENT if committed or being stored; else NEW with a slot (a free
        ready slot, else one freed by evicting unpinned victims); NO_SPACE once nothing is left,
        and for every key during the quarantine after a reused pool file (`start`).

        `announce`: per key, what KV events say of its block (events.py), or nothing.
        `salts`: the keys' cache salts, for per-tenant quotas (--tenants; tenants.py)."""
        if announce:
            check_announce(announce)
        with self._lock:
            reservation = self._reserve_store(namespace_id, client_id, keys, salts)
            if announce and reservation.store_id:
                self._remember_announce(namespace_id, keys, announce, reservation)
            return reservation

    def _remember_announce(
        self,
        namespace_id: str,
        keys: bytes,
        announce: Sequence[bytes],
        reservation: StoreReservation,
    ) -> None:
        """Lock held: keep the NEW keys' announce blobs with the open store."""
        ns = self._namespaces[namespace_id]
        if ns.events is None:
            return
        key_list = split_keys(keys, ns.spec.key_size)
        new = [i for i, d in enumerate(reservation.decisions) if d == _NEW]
        ns.events.reserved(
            reservation.store_id,
            [key_list[i] for i in new],
            [announce[i] if i < len(announce) else b"" for i in new],
        )

    def _reserve_store(
        self, namespace_id: str, client_id: int, keys: bytes, salts: KeySalts | None = None
    ) -> StoreReservation:
        """Lock held: `reserve_store` without the announce blobs."""
        self._check_serving()
        ns = self._namespace(namespace_id)
        client = self._owned_client(ns, client_id)
        packed, n_keys = check_packed(keys, ns.spec.key_size)
        if self._presence is not None:  # before any key can be committed (presence.py)
            self._mark_present(packed, ns.spec.key_size)
        if self._earlier_writers():  # a worker of the file's earlier contents may still copy
            return StoreReservation(0, (_NO_SPACE,) * n_keys, ())  # a skipped store
        if not self._region.intact():  # the reaper rebuilds the file; writing it is SIGBUS
            return StoreReservation(0, (_NO_SPACE,) * n_keys, ())
        engine = client.engine
        if not self._engine_armed(ns, engine):
            # a rank without its lock could write while the death probe says nobody does
            ns.counters.unlocked_reservations += 1
            return StoreReservation(0, (_NO_SPACE,) * n_keys, ())
        owner = ns.engines[engine]
        index, free, tenants = ns.index, ns.free, ns.tenants
        new_slots = self._reserve_new(ns, packed, n_keys) if tenants is None else None
        if new_slots is not None:  # the usual store: every key new, distinct, slots free
            ns.table.mark(new_slots, persist.RESERVED, self._now_ms(), engine)  # before any byte
            store_id = self._next_store
            self._next_store += 1
            index.open_store_packed(store_id, engine, new_slots, packed)
            owner.stores.add(store_id)
            return StoreReservation(store_id, (_NEW,) * n_keys, new_slots)
        key_list = split_keys(packed, ns.spec.key_size)
        found = index.slots_of(key_list)
        missing = found.count(None)
        if not missing:
            return StoreReservation(0, (_PRESENT,) * len(key_list), ())
        if missing == len(found):
            fresh = key_list
        else:
            fresh = list(compress(key_list, map(is_, found, repeat(None))))
        unique = len(set(fresh)) == len(fresh)
        if not unique:
            fresh = list(dict.fromkeys(fresh))  # first occurrences, in key order
        refused: list[PoolKey] = []
        if tenants is not None:  # quotas: what each tenant may store, room made for it
            fresh, refused, owners = self._admit_tenants(ns, tenants, key_list, fresh, salts)
        shortfall = len(fresh) - free.available()
        if shortfall > 0:
            self._evict(ns, shortfall, self._protected(index, key_list))
        # Eviction only removes keys: `fresh` is still exactly the keys not in the index.
        slots = free.allocate_many(len(fresh))
        stored = fresh if len(slots) == len(fresh) else fresh[: len(slots)]
        slot_list = index.reserve_many(stored, slots, keys_free=True)
        unstored = fresh[len(slots) :]
        decisions = _store_decisions(key_list, stored, unstored + refused, unique)
        store_id = 0
        if slot_list:
            ns.table.mark(slot_list, persist.RESERVED, self._now_ms(), engine)  # before any byte
            store_id = self._next_store
            self._next_store += 1
            index.open_store(store_id, engine, slots, stored)
            owner.stores.add(store_id)
            if tenants is not None:
                tenants.reserve(stored, owners if type(owners) is int else owners[: len(stored)])
        return StoreReservation(store_id, decisions, tuple(slot_list))

    def _admit_tenants(
        self,
        ns: _Namespace,
        tenants: TenantPolicy,
        key_list: list[PoolKey],
        fresh: list[PoolKey],
        salts: KeySalts | None,
    ) -> tuple[list[PoolKey], list[PoolKey], int | list[int]]:
        """Lock held: per tenant of the batch (tenants.py), how many of its fresh keys it may
        store, with the victims evicted to make room. Returns the admitted keys (key order),
        the refused ones (NO_SPACE) and the admitted keys' tenant (one, or one per key)."""
        owners = tenants.key_tenants(salts, len(key_list))
        groups: dict[int, list[PoolKey]]
        if type(owners) is int:
            groups = {owners: fresh}
        else:
            first = dict(zip(reversed(key_list), reversed(owners), strict=True))  # first wins
            groups = {}
            for key in fresh:
                groups.setdefault(first[key], []).append(key)
        self._apply_touches(ns)
        protected = self._protected(ns.index, key_list)
        may_evict = not (self._evict_from and self._clock() < self._evict_from)
        available = ns.free.available()
        admitted: list[PoolKey] = []
        refused: list[PoolKey] = []
        for tenant, keys in groups.items():
            count, victims = tenants.admit(
                tenant, len(keys), available, protected, may_evict=may_evict
            )
            if victims:
                self._drop_victims(ns, victims)
            available += len(victims) - count
            admitted += keys[:count]
            refused += keys[count:]
        if len(groups) == 1:
            (tenant,) = groups
            return admitted, refused, tenant
        kept = set(admitted)
        admitted = [k for k in fresh if k in kept]  # key order, as the index reserves them
        return admitted, refused, [first[k] for k in admitted]

    def attach_presence(self, presence: PresenceMap) -> None:
        """Keep `presence` (presence.py) true from now on: every live key marked at once (the
        adopted ones too), every key a store reserves marked before it can be committed."""
        with self._lock:
            self._presence = presence
            self._rebuild_presence()

    def _mark_present(self, packed: bytes, key_size: int) -> None:
        """Lock held."""
        presence = self._presence
        assert presence is not None
        # a rebuild marks the index's keys only: it runs before this batch is marked, never
        # after (the batch's new keys are not in the index yet)
        if presence.rebuild_due(sum(ns.index.live_keys() for ns in self._namespaces.values())):
            self._rebuild_presence()
        presence.mark_packed(packed, key_size)

    def _rebuild_presence(self) -> None:
        """Lock held: the live keys of every namespace (reserved or committed) only."""
        if self._presence is not None:
            self._presence.rebuild(
                [
                    (ns.index.live_keys_packed(), ns.spec.key_size)
                    for ns in self._namespaces.values()
                ]
            )

    @staticmethod
    def _reserve_new(ns: _Namespace, packed: bytes, n: int) -> np.ndarray | None:
        """The fast path of `reserve_store` for a large batch of keys that are all new and fit
        in the free slots: allocate, then insert and check in one key-map pass over the packed
        request. The slots when that worked, else None with nothing changed (a key is known or
        repeats, the batch is small, or eviction is needed): the caller takes the general
        path."""
        free = ns.free
        if n <= allocator.VECTOR_MIN or n > free.available():
            return None
        mark = free.mark()
        slots = free.allocate_many(n)
        if not ns.index.reserve_new_packed(packed, slots):
            free.rewind(mark)
            return None
        return slots

    @staticmethod
    def _protected(index: SlotIndex, request: Sequence[PoolKey]) -> Container[PoolKey]:
        """What eviction must spare: the request's keys and, when any, the pinned keys."""
        if not index.counts.pinned:
            return set(request)  # a plain set: membership tests stay in C
        return _Protected(index, set(request))

    def _evict(self, ns: _Namespace, n: int, protected: Container[PoolKey]) -> None:
        """Free `n` slots by eviction, or as many as the policy can give when fewer are evictable.

        `evict` is all-or-nothing, so on a refusal ask for half as many and keep going: at most
        O(log n) refused calls, ending with every evictable victim gone when n is out of reach.
        """
        self._apply_touches(ns)
        if self._evict_from and self._clock() < self._evict_from:
            return  # adopted blocks may still be read by the dead instance's clients' loads
        ask = n
        while n > 0 and ask > 0:
            victims = ns.policy.evict(ask, protected)
            if victims is None:
                ask //= 2
                continue
            self._drop_victims(ns, victims)
            n -= len(victims)
            ask = min(ask, n)

    @staticmethod
    def _drop_victims(ns: _Namespace, victims: Sequence[PoolKey]) -> None:
        """Lock held: evicted keys leave the index (their slots free), counted and logged for KV
        events; the one place both eviction paths (`_evict`, `_admit_tenants`) go through."""
        ns.free.release_many(ns.index.evict_many(victims))
        ns.counters.evicted_blocks += len(victims)
        if ns.events is not None:
            ns.events.removed(victims)

    def commit_store(
        self,
        namespace_id: str,
        store_id: int,
        rank: int,
        *,
        epoch: int | None = None,
        engine: int | None = None,
    ) -> bool:
        """Rank `rank` wrote its part of the store. True when every rank has (keys now visible);
        repeating a rank's commit is harmless. `epoch` and `engine` (None: not checked, for
        in-process callers) name the sidecar instance that answered the reservation and the
        engine it belongs to: another one is refused (FailedPrecondition, counted), so a late
        commit can never make another instance's or engine's slots visible."""
        with self._lock:
            ns = self._namespace(namespace_id)
            self._check_id(store_id, "store id")
            self._check_fence(ns, store_id, epoch, engine, "commit")
            record = ns.index.stores.get(store_id)
            keys = ns.index.commit_rank(store_id, rank)
            if keys is None:
                return False
            if record is not None:  # it just completed (else a repeat of a completed store)
                self._apply_touches(ns)
                insert = ns.policy.insert
                for key in keys:
                    insert(key)
                if self._region.intact():  # the commit record: visible after a restart too
                    owners = ns.tenants.codes(keys) if ns.tenants is not None else 0
                    ns.table.commit(record.slots, b"".join(keys), self._commit_seq, owners)
                    self._commit_seq += 1
                ns.counters.stored_blocks += len(keys)
                if ns.events is not None:
                    ns.events.committed(store_id, keys)
                self._store_done(ns, record)
            ns.last_used = self._clock()
            return True

    def _check_fence(
        self, ns: _Namespace, store_id: int, epoch: int | None, engine: int | None, what: str
    ) -> None:
        """Lock held: FailedPrecondition (counted) for a commit or abort naming another sidecar
        instance, or a store of another engine."""
        if epoch is not None and epoch != self.epoch:
            ns.counters.refused_commits += 1
            raise FailedPrecondition(
                f"{what} of store {store_id} names sidecar instance {epoch:#x}, this is "
                f"{self.epoch:#x} (its reservation died with that instance)"
            )
        record = ns.index.stores.get(store_id)
        if engine is not None and record is not None and record.owner != engine:
            ns.counters.refused_commits += 1
            raise FailedPrecondition(
                f"{what} of store {store_id} by engine {engine}: it belongs to {record.owner}"
            )

    @staticmethod
    def _store_done(ns: _Namespace, record: StoreRecord) -> None:
        owner = ns.engines.get(record.owner)
        if owner is not None:
            owner.stores.discard(record.store_id)

    def abort_store(
        self,
        namespace_id: str,
        store_id: int,
        *,
        epoch: int | None = None,
        engine: int | None = None,
    ) -> int:
        """Give back an open store reservation; returns the slots freed. Its engine calls it
        once every rank finished (or never started) the store's copies; `epoch` and `engine`
        as for `commit_store`."""
        with self._lock:
            ns = self._namespace(namespace_id)
            self._check_id(store_id, "store id")
            self._check_fence(ns, store_id, epoch, engine, "abort")
            _, slots = self._abort(ns, store_id)
            return len(slots)

    def _abort(self, ns: _Namespace, store_id: int) -> tuple[StoreRecord | None, Slots]:
        """Lock held: an open store's slots are free again (index, tenants, event log, slot
        table, free list); its record (None when unknown) and the slots freed."""
        record = ns.index.stores.get(store_id)
        slots = ns.index.abort_store(store_id)
        if record is not None:
            self._store_done(ns, record)
        if ns.tenants is not None and record is not None:
            ns.tenants.abort(record.keys or ())  # the abort cut them into `keys`
        if ns.events is not None:
            ns.events.aborted(store_id)
        self._mark_free(ns, slots)
        ns.free.release_many(slots)
        return record, slots

    def events(
        self, namespace_id: str, log_id: str, after_seq: int, cursor: int, max_events: int
    ) -> EventPage:
        """Blocks that became visible or were evicted since the caller's position in the
        namespace's event log, or a page of a snapshot of every visible block (events.py)."""
        with self._lock:
            ns = self._namespace(namespace_id)
            assert ns.events is not None  # every namespace gets its log at creation
            self._apply_touches(ns)
            return ns.events.page(log_id, after_seq, cursor, max_events, ns.policy.keys())

    # -- observation --------------------------------------------------------------------------

    def stats(self) -> PoolStats:
        with self._lock:
            now = self._clock()
            region = self._region
            return PoolStats(
                pool_bytes=self.settings.pool_size,
                prefaulted_bytes=region.prefaulted_bytes,
                pool_ready=region.done,
                eviction_policy=self.settings.eviction,
                pool_generation=self.generation,
                namespaces=tuple(self._ns_stats(ns, now) for ns in self._namespaces.values()),
                uptime_seconds=now - self._started_at,
                adoption=replace(self.adoption, discarded=dict(self.adoption.discarded)),
            )

    def _ns_stats(self, ns: _Namespace, now: float) -> NamespaceStats:
        c, k, sb = ns.index.counts, ns.counters, ns.slot_bytes
        return NamespaceStats(
            namespace_id=ns.namespace_id,
            spec=ns.spec,
            num_ranks=ns.num_ranks,
            slot_bytes=sb,
            slot_count=ns.slot_count,
            committed_slots=c.committed,
            reserved_slots=c.reserved,
            pinned_slots=c.pinned,
            live_clients=sum(1 for cid in ns.clients if self._is_live(self._clients[cid], now)),
            capacity_bytes=ns.slot_count * sb,
            used_bytes=(c.committed + c.reserved) * sb,
            pinned_bytes=c.pinned * sb,
            lookups=k.lookups,
            hit_blocks=k.hit_blocks,
            miss_blocks=k.miss_blocks,
            queried_blocks=k.queried_blocks,
            stored_blocks=k.stored_blocks,
            loaded_blocks=k.loaded_blocks,
            evicted_blocks=k.evicted_blocks,
            stored_bytes=k.stored_blocks * sb,
            loaded_bytes=k.loaded_blocks * sb,
            tenants=ns.tenants.stats(sb) if ns.tenants is not None else (),
            refused_commits=k.refused_commits,
            unlocked_reservations=k.unlocked_reservations,
            withheld_slots=len(ns.withheld),
        )

    def check_invariants(self) -> None:
        """AssertionError naming the first violated invariant (tests, fuzzing; O(slots))."""
        with self._lock:
            for i, owner in enumerate(self._partitions):
                if owner is not None:
                    assert self._namespaces[owner].partition == i, f"partition {i} owner mismatch"
            assert len({ns.partition for ns in self._namespaces.values()}) == len(
                self._namespaces
            ), "two namespaces share a partition"
            for ns in self._namespaces.values():
                self._check_namespace(ns)
            for cid, client in self._clients.items():
                ns = self._namespaces.get(client.namespace_id)
                assert ns is not None and cid in ns.clients, f"client {cid} has no namespace"

    def _check_namespace(self, ns: _Namespace) -> None:
        nid, index = ns.namespace_id, ns.index
        withheld = set(ns.withheld.tolist())
        assert len(ns.withheld) == len(ns.withheld_owners), f"{nid}: withheld slots' owners"
        try:
            index.check(ns.free.free_slots() | withheld)
        except AssertionError as e:
            raise AssertionError(f"namespace {nid}: {e}") from None
        assert not (withheld & ns.free.free_slots()), f"{nid}: a withheld slot is free"
        for slot in range(max(ns.free.ready, ns.free.fresh), ns.slot_count):
            assert index.state(slot) == SlotState.FREE, f"{nid}: slot {slot} used before ready"
        committed = index.committed_keys()
        if self._region.intact():
            self._check_table(ns, committed)
        self._apply_touches(ns)
        held = set(ns.policy.keys())
        assert len(held) == len(ns.policy), f"{nid}: policy holds a key twice"
        assert held == committed, (
            f"{nid}: policy holds {len(held)} keys, {len(committed)} are committed"
        )
        if ns.tenants is not None:
            reserved = {k for r in index.stores.values() for k in index._keys_of(r)}
            try:
                ns.tenants.check(reserved)
            except AssertionError as e:
                raise AssertionError(f"namespace {nid}: {e}") from None
        client_pins: set[int] = set()
        for cid in ns.clients:
            client = self._clients.get(cid)
            assert client is not None and client.namespace_id == nid, f"{nid}: stray client {cid}"
            assert not (client_pins & client.pins), f"{nid}: a pin belongs to two clients"
            client_pins |= client.pins
            for pin_id in client.pins:
                assert index.pin_records[pin_id].client_id == cid, f"{nid}: pin {pin_id} owner"
        assert client_pins == set(index.pin_records), f"{nid}: pins of no live client"
        engine_stores: set[int] = set()
        for key, engine in ns.engines.items():
            assert engine.engine == key, f"{nid}: engine record {key} names {engine.engine}"
            assert not (engine_stores & engine.stores), f"{nid}: a store belongs to two engines"
            engine_stores |= engine.stores
            for store_id in engine.stores:
                assert index.stores[store_id].owner == key, f"{nid}: store {store_id} owner"
        assert engine_stores == set(index.stores), f"{nid}: reserved slots of no known engine"

    @staticmethod
    def _check_table(ns: _Namespace, committed: set[PoolKey]) -> None:
        """The file's records agree with the index: every committed key has a valid record in
        its slot (more valid records may remain in free slots: evicted, intact blocks); every
        reserved slot is marked reserved."""
        scan = ns.table.scan()
        recorded = dict(
            zip(
                scan.slots.tolist(),
                split_keys(scan.packed, ns.spec.key_size, max_keys=max(1, len(scan.slots))),
                strict=True,
            )
        )
        for key in committed:
            slot = ns.index.find(key)
            assert recorded.get(slot) == key, f"{ns.namespace_id}: slot {slot} has no record"
        for record in ns.index.stores.values():
            for slot in _slot_list(record.slots):
                assert ns.table.state[slot] == persist.RESERVED, (
                    f"{ns.namespace_id}: reserved slot {slot} is not marked in the file"
                )

    def flush_deferred(self) -> None:
        """Apply the deferred policy touches of lookups and loads now.

        `lookup` and `reserve_load` queue their hits' `policy.touch` instead of running it
        (~25 µs per 1,024 keys): the servicer calls this right after it has sent the answer, so
        the touch runs while the reply travels instead of before it. Every policy read or
        change (evict, insert, invariant checks) applies the queue first, in call order, so the
        policy's state and every eviction decision are exactly those of touching at once.
        """
        if not self._deferred:  # the usual case after a small call: no lock taken
            return
        with self._lock:
            self._deferred = False
            for ns in self._namespaces.values():
                self._apply_touches(ns)

    # -- helpers (lock held) ------------------------------------------------------------------

    def _touch_packed(self, ns: _Namespace, packed: bytes, n: int) -> None:
        """`policy.touch` of the first n packed keys, deferred (still packed: cutting them into
        keys waits too) until `flush_deferred` or the next policy use; a few keys are touched
        at once instead, cheaper than queueing, when nothing is queued."""
        ks = ns.spec.key_size
        hit = packed if n * ks == len(packed) else packed[: n * ks]
        if n < DEFER_TOUCH_MIN and not ns.touches:
            ns.policy.touch(split_keys(hit, ks))
            return
        ns.touches.append(hit)
        ns.touched += n
        self._deferred = True
        if ns.touched > MAX_DEFERRED_TOUCHES:
            self._apply_touches(ns)

    @staticmethod
    def _apply_touches(ns: _Namespace) -> None:
        if ns.touches:
            touch, ks = ns.policy.touch, ns.spec.key_size
            for packed in ns.touches:
                touch(split_keys(packed, ks, max_keys=len(packed)))
            ns.touches.clear()
            ns.touched = 0

    def _check_serving(self) -> None:
        if self._draining:
            raise Unavailable("the pool is draining")
        if not self._started:
            raise FailedPrecondition("the pool is not started")

    def _namespace(self, namespace_id: str) -> _Namespace:
        ns = self._namespaces.get(namespace_id) if isinstance(namespace_id, str) else None
        if ns is None:
            raise NotFound(f"unknown namespace {namespace_id!r}")
        return ns

    def _client(self, client_id: int) -> _Client:
        self._check_id(client_id, "client id")
        client = self._clients.get(client_id)
        if client is None:
            raise NotFound(f"unknown client {client_id} (never registered, detached or reaped)")
        return client

    def _owned_client(self, ns: _Namespace, client_id: int) -> _Client:
        client = self._client(client_id)
        if client.namespace_id != ns.namespace_id:
            raise NotFound(f"client {client_id} is not registered in namespace {ns.namespace_id}")
        client.last_seen = self._clock()
        ns.last_used = client.last_seen
        return client

    @staticmethod
    def _check_id(value: object, what: str) -> None:
        if not _is_int(value) or not 0 <= value <= MAX_ID:  # type: ignore[operator]
            raise InvalidArgument(f"{what} must be an unsigned 64-bit integer, got {value!r}")

    @staticmethod
    def _check_queries(ns: _Namespace, queries: Iterable[bytes]) -> list[tuple[bytes, int]]:
        """(packed keys, key count) per query, every one checked before any is looked up."""
        if isinstance(queries, (bytes, str)):
            raise InvalidArgument("queries must be a sequence of packed key lists")
        out: list[tuple[bytes, int]] = []
        total = 0
        for q in queries:
            if len(out) >= MAX_KEYS_PER_CALL:
                raise InvalidArgument(f"more than {MAX_KEYS_PER_CALL} queries in one lookup")
            packed, n = check_packed(q, ns.spec.key_size)
            total += n
            if total > MAX_KEYS_PER_CALL:
                raise InvalidArgument(f"more than {MAX_KEYS_PER_CALL} keys in one lookup")
            out.append((packed, n))
        return out


def _slot_list(slots: Sequence[int] | np.ndarray) -> list[int]:
    return slots.tolist() if isinstance(slots, np.ndarray) else list(slots)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _store_decisions(
    keys: Sequence[PoolKey], stored: Sequence[PoolKey], unstored: Sequence[PoolKey], unique: bool
) -> tuple[StoreDecision, ...]:
    """Per key: NEW for the first occurrence of a stored key, NO_SPACE for every occurrence of
    a fresh key that got no slot, PRESENT otherwise (in the index already, or a repeat)."""
    if len(stored) == len(keys):
        return (_NEW,) * len(keys)
    decide: dict[PoolKey, StoreDecision] = dict.fromkeys(stored, _NEW)
    if unstored:
        decide.update(dict.fromkeys(unstored, _NO_SPACE))
    if unique:  # one C-level pass: keys outside `decide` are PRESENT
        return tuple(map(decide.get, keys, repeat(_PRESENT)))  # type: ignore[arg-type]
    decisions: list[StoreDecision] = []
    for key in keys:
        decision = decide.get(key, _PRESENT)
        if decision is _NEW:
            decide[key] = _PRESENT  # a repeat of a stored key is PRESENT
        decisions.append(decision)
    return tuple(decisions)
