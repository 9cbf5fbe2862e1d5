"""Where each part of the pool file lives: constants of the format, the partitions
(`PoolGeometry`) and a namespace's regions, slot table, spec and header (`NamespaceLayout`).
No I/O (the spec as JSON included); the format and why it survives a crash: persist.py."""

from __future__ import annotations

import hashlib
import json
import mmap
import secrets
from dataclasses import dataclass, fields

import numpy as np

from kvoffload_sidecar.host import HUGE_PAGE_BYTES
from kvoffload_sidecar.keys import NamespaceId, NamespaceSpec, derive_namespace
from kvoffload_sidecar.units import align_down, align_up

FORMAT_VERSION = 2  # 2: reserved records name their owning engine
READABLE_VERSIONS = frozenset({2})  # formats this sidecar adopts; others are discarded
HEADER_BYTES = 4096
NS_HEADER_BYTES = 4096
PAGE = mmap.PAGESIZE
POOL_MAGIC = b"KVOFFPL\x00"
NS_MAGIC = b"KVOFFNS\x00"
FREE, RESERVED, FIRST_SEQ = 0, 1, 2
TENANT_SHIFT = 56  # last-use word: tenant code in the top 8 bits, the use sequence below
USE_MASK = np.uint64((1 << TENANT_SHIFT) - 1)
TENANT_BITS = np.uint64(~((1 << TENANT_SHIFT) - 1) & ((1 << 64) - 1))
MAX_SLOTS = (1 << 32) - 1


def header_digest(*parts: bytes) -> bytes:
    return hashlib.blake2b(b"".join(parts), digest_size=8).digest()


@dataclass(frozen=True)
class PoolGeometry:
    """How the file is cut: `max_namespaces` partitions of `partition_bytes`, regions aligned to
    `align` (the huge-page size on hugetlbfs, else the page size)."""

    pool_size: int
    max_namespaces: int
    partition_bytes: int
    align: int

    @property
    def header_offset(self) -> int:
        return self.pool_size - HEADER_BYTES


def geometry(pool_size: int, max_namespaces: int, hugepages: bool) -> PoolGeometry:
    align = HUGE_PAGE_BYTES if hugepages else PAGE
    usable = max(0, pool_size - HEADER_BYTES)
    return PoolGeometry(
        pool_size, max_namespaces, align_down(usable // max_namespaces, align), align
    )


def record_bytes(key_size: int) -> int:
    return 24 + align_up(key_size, 8)


def encode_spec(spec: NamespaceSpec) -> bytes:
    doc = {f.name: getattr(spec, f.name) for f in fields(NamespaceSpec)}
    doc["extra"] = [list(pair) for pair in spec.extra]
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def decode_spec(raw: bytes) -> NamespaceSpec:
    doc = json.loads(raw)
    doc["extra"] = tuple(tuple(pair) for pair in doc["extra"])
    return NamespaceSpec(**doc)


@dataclass(frozen=True)
class NamespaceLayout:
    """Where one namespace lives in its partition (what its header records)."""

    namespace_id: NamespaceId
    spec: NamespaceSpec
    partition: int
    num_ranks: int
    slot_bytes_per_rank: int
    slot_count: int
    base: int  # rank r's region starts at base + r * per_rank_bytes
    per_rank_bytes: int
    table_offset: int
    record_bytes: int
    spec_offset: int
    spec_json: bytes
    header_offset: int
    epoch: int

    def rank_offset(self, rank: int) -> int:
        return self.base + rank * self.per_rank_bytes


def plan_namespace(
    geom: PoolGeometry,
    partition: int,
    spec: NamespaceSpec,
    num_ranks: int,
    slot_bytes_per_rank: int,
    *,
    epoch: int | None = None,
) -> NamespaceLayout | None:
    """The layout of a namespace in `partition`: rank regions from the partition's start, its
    index at the partition's end. None when not one slot fits."""
    spec_json = encode_spec(spec)
    rec = record_bytes(spec.key_size)
    base = partition * geom.partition_bytes
    end = base + geom.partition_bytes
    header_offset = end - NS_HEADER_BYTES
    spec_offset = header_offset - align_up(len(spec_json), PAGE)
    upper = geom.partition_bytes // (num_ranks * slot_bytes_per_rank)  # >= the slots that fit
    room = spec_offset - align_up(upper * rec, PAGE) - base
    per_rank = align_down(max(0, room) // num_ranks, geom.align)
    slot_count = min(per_rank // slot_bytes_per_rank, MAX_SLOTS)
    if slot_count < 1:
        return None
    table_offset = spec_offset - align_up(slot_count * rec, PAGE)
    return NamespaceLayout(
        namespace_id=derive_namespace(spec),
        spec=spec,
        partition=partition,
        num_ranks=num_ranks,
        slot_bytes_per_rank=slot_bytes_per_rank,
        slot_count=slot_count,
        base=base,
        per_rank_bytes=per_rank,
        table_offset=table_offset,
        record_bytes=rec,
        spec_offset=spec_offset,
        spec_json=spec_json,
        header_offset=header_offset,
        epoch=secrets.randbits(63) if epoch is None else epoch,
    )
