"""What crosses between the scheduler and the workers (no torch).

Scheduler -> workers: `ConnectorMeta` (one per engine step, pickled inside
vLLM's SchedulerOutput). Workers -> scheduler: `WorkerReport` (one per step
and rank; vLLM merges the ranks with `aggregate`). Plain frozen dataclasses of
ints, strings and tuples so they pickle cheaply.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvoffload_connector.common.compat import (
    ConnectorMetadataBase,
    HandshakeMetadataBase,
    WorkerMetadataBase,
)
from kvoffload_connector.common.keys import SpecFields


@dataclass(frozen=True)
class GroupTransfer:
    """Blocks of one KV group and where each lies in the pool.

    Block i of the transfer is GPU block `gpu_blocks[i]`, stored in pool slot
    `slots[i]` at block position `slot_block_index[i]` of that slot's chunk.
    """

    group: int
    gpu_blocks: tuple[int, ...]
    slots: tuple[int, ...]
    slot_block_index: tuple[int, ...]

    def __post_init__(self) -> None:
        if not (len(self.gpu_blocks) == len(self.slots) == len(self.slot_block_index)):
            raise ValueError("gpu_blocks, slots and slot_block_index differ in length")


@dataclass(frozen=True)
class LoadJob:
    """Pool -> GPU for one request; its slots are pinned until the job completes."""

    job_id: int
    req_id: str
    transfers: tuple[GroupTransfer, ...]
    generation: str  # pool generation the slots belong to; a worker on another one fails it
    layered: bool = False  # the request runs this step: its layers wait for their bytes
    # per transfer, per slot: the slot's version when pinned (its slot record's state word).
    # After the copy completed the worker reads the words again: any difference (or a 0, or
    # none given) fails the load, and vLLM recomputes.
    versions: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class StoreJob:
    """GPU -> pool for one store reservation; each rank commits it when written."""

    job_id: int
    store_id: int
    namespace_id: str
    transfers: tuple[GroupTransfer, ...]
    generation: str
    epoch: int = 0  # the sidecar instance that answered the reservation (the commit names it)
    engine: int = 0  # the engine it belongs to


@dataclass(frozen=True)
class ConnectorMeta(ConnectorMetadataBase):
    loads: tuple[LoadJob, ...] = ()
    stores: tuple[StoreJob, ...] = ()
    # most tokens any request computes this step (0: unknown). Longer than a uniform decode
    # query means a mixed batch, which vLLM never replays as one full CUDA graph.
    longest_query: int = 0
    # jobs whose GPU blocks vLLM got back before they finished (a prefix-cache reset): each
    # worker completes them before this step's forward can write into those blocks
    fence: tuple[int, ...] = ()
    # this engine's key (the scheduler's): each worker holds its rank's engine lock for it
    # before any store copy (engine_lock.py)
    engine: int = 0


@dataclass(frozen=True)
class Registration:
    """A worker's registration, forwarded so the scheduler can join the same namespace."""

    spec: SpecFields
    num_ranks: int
    slot_bytes_per_rank: int
    namespace_id: str
    generation: str


@dataclass(frozen=True)
class PoolHandshake(HandshakeMetadataBase):
    """A worker's registration handed to its scheduler at engine start, through vLLM's
    handshake metadata (`get_handshake_metadata` -> `set_xfer_handshake_metadata`)."""

    registration: Registration
    # slots [0, n) of the rank's region it could copy when it answered (its registered pieces)
    # and whether that is all of them: the scheduler plans loads below every rank's end
    usable_end: int = 0
    ready: bool = False


def _merge(a: Mapping[int, int], b: Mapping[int, int]) -> dict[int, int]:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out


@dataclass(frozen=True)
class WorkerReport(WorkerMetadataBase):
    done: Mapping[int, int] = field(default_factory=dict)  # job id -> ranks finished ok
    failed: Mapping[int, int] = field(default_factory=dict)  # job id -> ranks that failed it
    registration: Registration | None = None  # set on the step after a (re-)registration
    # rank -> pool mapped and registered with the device; sent when it changes. Until every
    # rank is ready the scheduler answers misses and plans no stores (no doomed jobs).
    ready: Mapping[int, bool] = field(default_factory=dict)
    # rank -> slots [0, n) of its region it may copy now (registered with the device so far),
    # sent with `ready`. The scheduler plans loads, and lets stores be copied, only for slots
    # below every rank's end: a hit past it is a miss, a store reserved past it is aborted.
    usable: Mapping[int, int] = field(default_factory=dict)
    # Set once when a rank found no pool to register with (sidecar refused or away, a KV cache
    # layout it cannot map): the scheduler stops holding requests for a first registration.
    no_pool: str = ""

    def aggregate(self, other: WorkerReport) -> WorkerReport:  # type: ignore[override]
        return WorkerReport(
            done=_merge(self.done, other.done),
            failed=_merge(self.failed, other.failed),
            registration=self.registration or other.registration,
            ready={**self.ready, **other.ready},
            usable={**self.usable, **other.usable},
            no_pool=self.no_pool or other.no_pool,
        )

    def is_empty(self) -> bool:
        return (
            not self.done
            and not self.failed
            and self.registration is None
            and not self.ready
            and not self.usable
            and not self.no_pool
        )
