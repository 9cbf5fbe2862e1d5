"""`Pool`: the sidecar's domain API, composed of region, index, allocator and policy.

The gRPC servicer decodes a request, calls one `Pool` method and encodes the answer; domain
errors (`kvoffload_sidecar.errors`) become status codes in one table there. Nothing here imports
grpc. KV bytes never pass through the pool: it only decides which slot holds which key and when a
slot may be read, written or reused (docs/ARCHITECTURE.md, Contract 1).

Thread contract: every public method takes `self._lock` (one lock) for its whole body; the
pre-fault thread takes it briefly after each chunk to advance the allocatable frontier.

`Pool` is composed of one part per job, each a class of methods over the same state
(pool_state.py) and answer types (pool_types.py), none importing another: pool_lifecycle
(start, pre-fault, a lost file, drain, close), pool_adoption (the index a dead sidecar left),
pool_clients (registration, namespaces, sessions, the reaper), pool_reclaim (engine ownership,
dead engines, withheld slots and drained reports), pool_lookups (lookups, pins, versions,
deferred touches), pool_stores (reservations, fenced commits and aborts, presence),
pool_eviction (eviction and tenant admission), pool_stats (Stats). This module holds the
constructor and the checks every part shares.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvoffload_sidecar import persist
from kvoffload_sidecar.engine_locks import (
    FileLocks,
    Liveness,
    generation_base,
)
from kvoffload_sidecar.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from kvoffload_sidecar.keys import NamespaceId
from kvoffload_sidecar.memfd_region import FdBacking, MemfdRegion
from kvoffload_sidecar.persist import Adoption
from kvoffload_sidecar.policies.factory import resolve_policy
from kvoffload_sidecar.pool_adoption import PoolAdoption
from kvoffload_sidecar.pool_clients import PoolClients
from kvoffload_sidecar.pool_eviction import PoolEviction
from kvoffload_sidecar.pool_lifecycle import PoolLifecycle
from kvoffload_sidecar.pool_lookups import PoolLookups
from kvoffload_sidecar.pool_reclaim import PoolReclaim
from kvoffload_sidecar.pool_state import (
    ClientState,
    NamespaceState,
    is_int,
)
from kvoffload_sidecar.pool_stats import PoolObservation
from kvoffload_sidecar.pool_stores import PoolStores
from kvoffload_sidecar.pool_types import (
    MAX_ID,
    LoadPin,
    NamespaceStats,
    PoolSettings,
    PoolStats,
    RankRegion,
    Registration,
    StoreDecision,
    StoreReservation,
)
from kvoffload_sidecar.presence import PresenceMap
from kvoffload_sidecar.region import PrefaultGate, Region

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


class Pool(
    PoolLifecycle,
    PoolAdoption,
    PoolClients,
    PoolReclaim,
    PoolLookups,
    PoolStores,
    PoolEviction,
    PoolObservation,
):
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
        backing: FdBacking | None = None,
    ) -> None:
        """`liveness(start, length)`: whether some process holds a lock on those bytes of the
        pool file (engine_locks.py); default: `F_OFD_GETLK` on the pool file itself.
        `backing`: the pool lives in that memfd instead of a file in `pool_dir` (node mode:
        memfd_region.py); the regions the pool hands out then name no path."""
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
        if backing is not None:
            if s.hugepages:
                raise ValueError("a pool in a memfd has no huge pages (hugepages is for files)")
            self._region: Region = MemfdRegion(
                backing,
                s.pool_size,
                lock=self._lock,
                chunk_bytes=s.prefault_chunk_bytes,
                numa_node=s.numa_node,
                prefault=s.prefault,
                gate=prefault_gate,
                on_progress=self._on_prefault_progress,
            )
        else:
            if s.pool_dir is None:
                raise ValueError("a pool needs pool_dir, or a memfd backing")
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
        self._namespaces: dict[NamespaceId, NamespaceState] = {}
        self._clients: dict[int, ClientState] = {}
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

    def _check_serving(self) -> None:
        if self._draining:
            raise Unavailable("the pool is draining")
        if not self._started:
            raise FailedPrecondition("the pool is not started")

    def _namespace(self, namespace_id: str) -> NamespaceState:
        ns = self._namespaces.get(namespace_id) if isinstance(namespace_id, str) else None
        if ns is None:
            raise NotFound(f"unknown namespace {namespace_id!r}")
        return ns

    def _client(self, client_id: int) -> ClientState:
        self._check_id(client_id, "client id")
        client = self._clients.get(client_id)
        if client is None:
            raise NotFound(f"unknown client {client_id} (never registered, detached or reaped)")
        return client

    def _owned_client(self, ns: NamespaceState, client_id: int) -> ClientState:
        client = self._client(client_id)
        if client.namespace_id != ns.namespace_id:
            raise NotFound(f"client {client_id} is not registered in namespace {ns.namespace_id}")
        client.last_seen = self._clock()
        ns.last_used = client.last_seen
        return client

    @staticmethod
    def _check_id(value: object, what: str) -> None:
        if not is_int(value) or not 0 <= value <= MAX_ID:  # type: ignore[operator]
            raise InvalidArgument(f"{what} must be an unsigned 64-bit integer, got {value!r}")
