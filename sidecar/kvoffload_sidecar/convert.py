"""Proto messages <-> Pool domain types; nothing else.

Encoders fill a message the caller owns (`out`) instead of returning a new one, so a Session
response embeds the result without a copy. Decoders raise `InvalidArgument` for what the proto
cannot express (a missing spec, a zero id); range checks beyond that are the Pool's.
"""

from __future__ import annotations

import dataclasses
import sys
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from kvoffload.v1 import pool_pb2 as pb

from kvoffload_sidecar.capacity import host_tokens, used_tokens
from kvoffload_sidecar.errors import InvalidArgument
from kvoffload_sidecar.events import EventPage
from kvoffload_sidecar.keys import NamespaceSpec
from kvoffload_sidecar.pool import StoreDecision
from kvoffload_sidecar.tenants import KeySalts

if TYPE_CHECKING:
    from kvoffload_sidecar.metrics import MethodLatency
    from kvoffload_sidecar.pool import (
        LoadPin,
        NamespaceStats,
        PoolStats,
        Registration,
        StoreReservation,
    )

MAX_CLIENT_NAME = 256


def require_namespace(namespace_id: str) -> str:
    if not namespace_id:
        raise InvalidArgument("namespace_id is required")
    return namespace_id


def require_id(value: int, name: str) -> int:
    if value == 0:
        raise InvalidArgument(f"{name} is required (0 is never a valid id)")
    return value


def spec_from_proto(msg: pb.NamespaceSpec) -> NamespaceSpec:
    """Proto spec -> validated NamespaceSpec (InvalidArgument names the bad field)."""
    spec = NamespaceSpec(
        model=msg.model,
        dtype=msg.dtype,
        kv_layout=msg.kv_layout,
        block_size=msg.block_size,
        chunk_blocks=msg.chunk_blocks,
        tp_size=msg.tp_size,
        hash_algo=msg.hash_algo,
        key_size=msg.key_size,
        extra=tuple(msg.extra.items()),
    )
    spec.validate()
    return spec


def spec_to_proto(spec: NamespaceSpec, out: pb.NamespaceSpec) -> None:
    out.model = spec.model
    out.dtype = spec.dtype
    out.kv_layout = spec.kv_layout
    out.block_size = spec.block_size
    out.chunk_blocks = spec.chunk_blocks
    out.tp_size = spec.tp_size
    out.hash_algo = spec.hash_algo
    out.key_size = spec.key_size
    out.extra.update(dict(spec.extra))


def register_args(msg: pb.RegisterRequest) -> tuple[NamespaceSpec, int, int, str, int]:
    """(spec, num_ranks, slot_bytes_per_rank, client_name, engine) for `Pool.register`."""
    if not msg.HasField("spec"):
        raise InvalidArgument("spec is required")
    if len(msg.client_name) > MAX_CLIENT_NAME:
        raise InvalidArgument(f"client_name is longer than {MAX_CLIENT_NAME} characters")
    return (
        spec_from_proto(msg.spec),
        msg.num_ranks,
        msg.slot_bytes_per_rank,
        msg.client_name,
        msg.engine,
    )


def registration_to_proto(reg: Registration, out: pb.RegisterResponse) -> None:
    out.namespace_id = reg.namespace_id
    out.client_id = reg.client_id
    for region in reg.regions:
        out.regions.add(
            rank=region.rank,
            path=region.path,
            offset=region.offset,
            slot_bytes=region.slot_bytes,
            slot_count=region.slot_count,
        )
    out.pool_ready = reg.pool_ready
    out.prefault_fraction = reg.prefault_fraction
    out.committed_blocks = reg.committed_blocks
    out.pool_generation = reg.pool_generation
    out.sidecar_epoch = reg.sidecar_epoch
    out.engine = reg.engine
    out.engine_lock_base = reg.engine_lock_base
    out.slot_table_offset = reg.slot_table_offset
    out.slot_record_bytes = reg.slot_record_bytes


def load_pin_to_proto(pin: LoadPin, out: pb.ReserveLoadResponse) -> None:
    out.pin_id = pin.pin_id
    out.slots = u32_le(pin.slots)
    out.versions = u64_le(pin.versions)


def store_reservation_to_proto(res: StoreReservation, out: pb.ReserveStoreResponse) -> None:
    out.store_id = res.store_id
    decisions = res.decisions
    # StoreDecision is an IntEnum with the proto's numbers: one byte per key. The usual answer,
    # every key NEW, skips the per-key conversion (`count` is one C pass).
    n = len(decisions)
    out.decisions = _NEW_BYTE * n if decisions.count(_NEW) == n else bytes(decisions)
    out.slots = u32_le(res.slots)


def key_salts(req: pb.ReserveStoreRequest) -> KeySalts | None:
    """A store batch's per-key cache salts (None when no key has one); checked by the pool."""
    if not req.key_salts:
        return None
    return KeySalts(tuple(req.cache_salts), req.key_salts)


def event_page_to_proto(page: EventPage, out: pb.EventsResponse) -> None:
    out.log_id = page.log_id
    out.seq = page.seq
    out.snapshot = page.snapshot
    out.cursor = page.cursor
    out.first = page.first
    add = out.events.add
    for e in page.events:
        add(seq=e.seq, removed=e.removed, key=e.key, announce=e.announce)


_NEW = StoreDecision.NEW
_NEW_BYTE = bytes([StoreDecision.NEW])
_BIG_ENDIAN = sys.byteorder == "big"
assert array("I").itemsize == 4, "the wire's slot numbers are 4-byte uint32s"


def u32_le(values: Sequence[int]) -> bytes:
    """Slot numbers as the wire packs them, 4-byte little-endian uint32s: one C pass (a
    repeated uint32 field costs a varint conversion per value on both sides)."""
    if isinstance(values, np.ndarray):
        return values.astype("<u4").tobytes()
    packed = array("I", values)
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def u64_le(values: Sequence[int]) -> bytes:
    """Slot versions as the wire packs them: 8-byte little-endian uint64s."""
    return np.asarray(values, dtype="<u8").tobytes()


def namespace_stats_to_proto(ns: NamespaceStats, out: pb.NamespaceStats) -> None:
    out.namespace_id = ns.namespace_id
    spec_to_proto(ns.spec, out.spec)
    for field in _NAMESPACE_COUNTERS:
        setattr(out, field, getattr(ns, field))
    for tenant in ns.tenants:
        out.tenants.add(**dataclasses.asdict(tenant))
    out.capacity_tokens = host_tokens(ns)
    out.used_tokens = used_tokens(ns)


_NAMESPACE_COUNTERS = (
    "num_ranks",
    "slot_bytes",
    "slot_count",
    "committed_slots",
    "reserved_slots",
    "pinned_slots",
    "live_clients",
    "capacity_bytes",
    "used_bytes",
    "pinned_bytes",
    "lookups",
    "hit_blocks",
    "miss_blocks",
    "stored_blocks",
    "loaded_blocks",
    "evicted_blocks",
    "stored_bytes",
    "loaded_bytes",
    "queried_blocks",
    "refused_commits",
    "unlocked_reservations",
    "withheld_slots",
    "prefaulted_slots",
)


def stats_to_proto(
    stats: PoolStats, latencies: Sequence[MethodLatency], version: str, out: pb.StatsResponse
) -> None:
    out.pool_bytes = stats.pool_bytes
    out.prefaulted_bytes = stats.prefaulted_bytes
    out.pool_ready = stats.pool_ready
    out.eviction_policy = stats.eviction_policy
    out.pool_generation = stats.pool_generation
    for ns in stats.namespaces:
        namespace_stats_to_proto(ns, out.namespaces.add())
    for lat in latencies:
        out.rpc_latency.add(
            method=lat.method,
            count=lat.count,
            p50_seconds=lat.p50_seconds,
            p99_seconds=lat.p99_seconds,
        )
    out.uptime_seconds = stats.uptime_seconds
    out.version = version
    a, found = stats.adoption, out.adoption
    found.outcome = a.outcome
    found.reason = a.reason
    found.format_version = a.format_version
    found.adopted_blocks = a.adopted_blocks
    found.adopted_namespaces = a.adopted_namespaces
    found.discarded_blocks.update(a.discarded)
    found.adopt_seconds = a.seconds
    found.boots = a.boots
