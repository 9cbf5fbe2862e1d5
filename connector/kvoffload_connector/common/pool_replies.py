"""What the sidecar's calls answer, as typed values (`Pinned`, `RegisterResult`,
`StoreReservation`), and the packing of their fields (key salts, slot lists, versions)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvoffload.v1 import pool_pb2

from kvoffload_connector.common.errors import PoolUnavailable
from kvoffload_connector.common.keys import unpack_slots


def no_salts(n: int) -> Sequence[None]:
    return (None,) * n


def key_salts(salts: Sequence[str | None]) -> tuple[list[str], bytes]:
    """A store batch's per-key salts as the contract packs them: the distinct salts, and per
    key 1 + its salt's index (0: none), one byte per key, two (little-endian) past 255 salts."""
    index: dict[str, int] = {}
    codes = []
    for s in salts:
        if s and (s in index or len(index) < 0xFFFF):
            codes.append(index.setdefault(s, len(index) + 1))
        else:  # no salt, or past the 65,535 salts two bytes name: the default tenant
            codes.append(0)
    if len(index) < 256:
        return list(index), bytes(codes)
    return list(index), b"".join(c.to_bytes(2, "little") for c in codes)


def slots_of(packed: bytes) -> list[int]:
    try:
        return unpack_slots(packed)
    except ValueError as e:  # a reply this client cannot read is no answer
        raise PoolUnavailable(f"malformed reply: {e}") from None


def versions_of(packed: bytes, n: int) -> list[int]:
    """Slot versions from a ReserveLoad reply (8-byte little-endian uint64s, one per slot);
    a sidecar that sent none (or a malformed list) gives zeros, which no load accepts."""
    if len(packed) != 8 * n:
        return [0] * n
    return list(struct.unpack(f"<{n}Q", packed))


class Pinned(NamedTuple):
    """One ReserveLoad's answer: the pin (0: nothing pinned), its slots and their versions."""

    pin_id: int
    slots: list[int]
    versions: list[int]


@dataclass(frozen=True)
class RankRegion:
    rank: int
    path: str
    offset: int
    slot_bytes: int
    slot_count: int


@dataclass(frozen=True)
class PoolName:
    """Which pool answered (the Register answer's `pool`): what this replica's /metrics names
    it by, so readers that gather replicas count a pool shared by several once."""

    placement: str  # "pod" | "node"
    pool_id: str  # the same through every pod that shares the pool
    node_pool: str = ""  # node placement: the KVOffloadNodePool, the node, the tenant
    node: str = ""
    tenant: str = ""
    pool_bytes: int = 0  # every namespace's

    @classmethod
    def from_response(cls, resp: pool_pb2.RegisterResponse) -> PoolName:
        p = resp.pool
        if p.pool_id:
            return cls(p.placement or "pod", p.pool_id, p.node_pool, p.node, p.tenant, p.pool_bytes)
        # a pool server that predates the field: its generation names the pool
        placement = "node" if resp.tenant_memory else "pod"
        return cls(placement, resp.pool_generation, tenant=resp.tenant_memory)


@dataclass(frozen=True)
class RegisterResult:
    namespace_id: str
    client_id: int
    regions: tuple[RankRegion, ...]
    pool_ready: bool
    committed_blocks: int
    generation: str
    epoch: int = 0  # the sidecar instance's: commits and aborts name it
    engine: int = 0  # the engine this client's reservations belong to
    engine_lock_base: int = 0  # engine_lock.lock_offset(base, engine, rank)
    slot_table_offset: int = 0  # slot i's version: the u64 at offset + i * record_bytes
    slot_record_bytes: int = 0
    # node placement: the tenant whose memfd holds the regions (their paths are empty, their
    # offsets into that memfd); empty for a sidecar's pool file
    tenant_memory: str = ""
    pool: PoolName | None = None  # which pool this is (placement, pool_id, size)

    @classmethod
    def from_response(cls, resp: pool_pb2.RegisterResponse) -> RegisterResult:
        return cls(
            namespace_id=resp.namespace_id,
            client_id=resp.client_id,
            regions=tuple(
                RankRegion(r.rank, r.path, r.offset, r.slot_bytes, r.slot_count)
                for r in resp.regions
            ),
            pool_ready=resp.pool_ready,
            committed_blocks=resp.committed_blocks,
            generation=resp.pool_generation,
            epoch=resp.sidecar_epoch,
            engine=resp.engine,
            engine_lock_base=resp.engine_lock_base,
            slot_table_offset=resp.slot_table_offset,
            slot_record_bytes=resp.slot_record_bytes,
            tenant_memory=resp.tenant_memory,
            pool=PoolName.from_response(resp),
        )


@dataclass(frozen=True)
class StoreReservation:
    store_id: int  # 0 when nothing is to be written
    decisions: bytes  # per key, one byte: its pool_pb2.StoreDecision value
    slots: list[int]  # one per NEW key, in key order
