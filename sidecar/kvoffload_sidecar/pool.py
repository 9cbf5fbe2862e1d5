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
    # A client whose last session ended keeps its pins and open store reservations this long:
    # copies its engine still had in flight on those slots cannot race their next owner.
    detach_grace_s: float = 2.0
    # After adopting a pool: slots the dead sidecar had reserved for stores stay out this long
    # (at least the grace): a copy its engines queued, then stalled, may still land in them.
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


@dataclass(frozen=True)
class LoadPin:
    """Pinned slots of the longest committed prefix; pin_id 0 and no slots when nothing hit."""

    pin_id: int
    slots: Sequence[int]  # a tuple, or an int array for batches above VECTOR_MIN


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


@dataclass(slots=True)
class _Client:
    client_id: int
    name: str
    namespace_id: NamespaceId
    last_seen: float
    sessions: int = 0
    detached_at: float | None = None  # its last session ended then: reaped after the grace
    pins: set[int] = field(default_factory=set)
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
    # when the last sidecar died: free once the grace is over
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
    ) -> None:
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
        self._withhold_until = 0.0  # clock time until which slots reserved at death stay out
        self.adoption = Adoption()
        self._draining = False
        self._deferred = False  # some namespace may have queued touches (`flush_deferred`)
        self._started = False
        self._started_at = clock()
        self._stores_from = 0.0  # clock time before which no store gets a slot (quarantine)
        self.generation = secrets.token_hex(8)
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
            # Loads the dead instance's clients had in flight may still read adopted blocks,
            # and stores write slots it had reserved: no eviction, and those slots stay
            # withheld, for the grace. Free slots take stores at once.
            self._evict_from = self._started_at + grace
        else:
            if found is None:
                adoption = Adoption("new", "no pool file was left: created one")
            else:
                adoption = Adoption("discarded", found.problem or "", found.format_version)
                # Copies the dead sidecar's clients had in flight may still land in the file
                # for a moment: no slot is handed out for stores until they are surely done.
                self._stores_from = self._started_at + grace
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
                "discarded the contents of the pool file %s: %s; stores start after %gs",
                self.path,
                adoption.reason,
                grace,
            )

    def _adopt_namespace(self, layout: NamespaceLayout, adoption: Adoption) -> None:
        """Lock held: a namespace read back from the file, with its committed blocks."""
        table = SlotTable(self._region.buffer, layout)
        scan = table.scan()
        withheld = self._still_held(scan.withheld, scan.withheld_ms)
        if len(withheld) < len(scan.withheld):  # reserved longer ago than the hold: free now
            table.mark(np.setdiff1d(scan.withheld, withheld), persist.FREE)
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

    def _still_held(self, slots: np.ndarray, reserved_ms: np.ndarray) -> np.ndarray:
        """Lock held, adopting: of the slots reserved when the last sidecar died, those whose
        reservation is younger than the hold (a copy may still land); moves `_withhold_until`
        to when the youngest comes free. A slot of unknown age (torn record) is held in full.
        Restarts in quick succession so never pile up slots reserved long ago."""
        if not len(slots):
            return slots
        hold = max(self.settings.detach_grace_s, self.settings.reserved_hold_s)
        now_ms = time.time() * 1e3
        ages = now_ms - reserved_ms.astype(np.float64)
        ages[reserved_ms == 0] = 0.0  # unknown: as if reserved now
        keep = ages < hold * 1e3
        if keep.any():
            left = hold - float(ages[keep].min()) / 1e3
            until = self._started_at + max(0.0, left)
            self._withhold_until = max(self._withhold_until, until)
        return slots[keep]

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
            self.generation = secrets.token_hex(8)
            now = self._clock()
            # Copies a connector still had in flight may land in the file for a moment.
            self._stores_from = now + self.settings.detach_grace_s
            self.rebuilds += 1
            self._evict_from = self._withhold_until = 0.0
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
        self, spec: NamespaceSpec, num_ranks: int, slot_bytes_per_rank: int, client_name: str
    ) -> Registration:
        """Attach an engine process to the namespace of `spec`, creating it on first use."""
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
            client = _Client(self._next_client, client_name, namespace_id, last_seen=now)
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
        idle = [
            ns
            for ns in self._namespaces.values()
            if not any(self._is_live(self._clients[c], now) for c in ns.clients)
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
        when 0) release its pins, abort its open store reservations, forget it (NotFound if
        unknown). The grace covers copies its engine may still have in flight on those slots
        (a session also ends when the client gives up on a silent sidecar)."""
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
        `client_timeout_s`; returns how many."""
        with self._lock:
            now = self._clock()
            if self._evict_from and now >= self._evict_from:
                self._evict_from = 0.0
            if self._withhold_until and now >= self._withhold_until:
                self._release_withheld()
            idle = [c for c in self._clients.values() if not self._is_live(c, now)]
            for client in idle:
                log.info("reaping idle client %d (%s)", client.client_id, client.name)
                self._forget_client(client)
            return len(idle)

    def _release_withheld(self) -> None:
        """Lock held: the dead instance's store copies are surely done: the slots they were
        writing become free."""
        self._withhold_until = 0.0
        intact = self._region.intact()
        for ns in self._namespaces.values():
            if len(ns.withheld):
                if intact:
                    ns.table.mark(ns.withheld, persist.FREE)
                ns.free.release_many(ns.withheld)
                ns.withheld = np.zeros(0, np.intp)

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
        ns = self._namespaces[client.namespace_id]
        for pin_id in client.pins:
            ns.index.unpin(pin_id)
        for store_id in client.stores:
            self._abort(ns, store_id)
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
            return LoadPin(pin_id, record.slots)

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
        if self._stores_from and self._clock() < self._stores_from:
            return StoreReservation(0, (_NO_SPACE,) * n_keys, ())  # a skipped store
        if not self._region.intact():  # the reaper rebuilds the file; writing it is SIGBUS
            return StoreReservation(0, (_NO_SPACE,) * n_keys, ())
        index, free, tenants = ns.index, ns.free, ns.tenants
        new_slots = self._reserve_new(ns, packed, n_keys) if tenants is None else None
        if new_slots is not None:  # the usual store: every key new, distinct, slots free
            ns.table.mark(new_slots, persist.RESERVED, self._now_ms())  # before any byte
            store_id = self._next_store
            self._next_store += 1
            index.open_store_packed(store_id, client.client_id, new_slots, packed)
            client.stores.add(store_id)
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
            ns.table.mark(slot_list, persist.RESERVED, self._now_ms())  # before any byte
            store_id = self._next_store
            self._next_store += 1
            index.open_store(store_id, client.client_id, slots, stored)
            client.stores.add(store_id)
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

    def commit_store(self, namespace_id: str, store_id: int, rank: int) -> bool:
        """Rank `rank` wrote its part of the store. True when every rank has (keys now visible);
        repeating a rank's commit is harmless."""
        with self._lock:
            ns = self._namespace(namespace_id)
            self._check_id(store_id, "store id")
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
                client = self._clients.get(record.client_id)
                if client is not None:
                    client.stores.discard(store_id)
            ns.last_used = self._clock()
            return True

    def abort_store(self, namespace_id: str, store_id: int) -> int:
        """Give back an open store reservation; returns the slots freed."""
        with self._lock:
            ns = self._namespace(namespace_id)
            self._check_id(store_id, "store id")
            record, slots = self._abort(ns, store_id)
            if record is not None:
                client = self._clients.get(record.client_id)
                if client is not None:
                    client.stores.discard(store_id)
            return len(slots)

    def _abort(self, ns: _Namespace, store_id: int) -> tuple[StoreRecord | None, Slots]:
        """Lock held: an open store's slots are free again (index, tenants, event log, slot
        table, free list); its record (None when unknown) and the slots freed."""
        record = ns.index.stores.get(store_id)
        slots = ns.index.abort_store(store_id)
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
        client_stores: set[int] = set()
        for cid in ns.clients:
            client = self._clients.get(cid)
            assert client is not None and client.namespace_id == nid, f"{nid}: stray client {cid}"
            assert not (client_pins & client.pins), f"{nid}: a pin belongs to two clients"
            client_pins |= client.pins
            client_stores |= client.stores
            for pin_id in client.pins:
                assert index.pin_records[pin_id].client_id == cid, f"{nid}: pin {pin_id} owner"
        assert client_pins == set(index.pin_records), f"{nid}: pins of no live client"
        assert client_stores == set(index.stores), f"{nid}: reserved slots of no live store id"
        for store_id, record in index.stores.items():
            assert record.client_id in ns.clients, f"{nid}: store {store_id} of a gone client"

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
