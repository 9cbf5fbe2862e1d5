"""The pool file's headers: the pool header (format, settings, generation, boots, the
--tenants digest) and each namespace's header with its spec. A header is invalid while it is
written and valid only once its check is in place."""

from __future__ import annotations

import hashlib
import mmap
import struct
from dataclasses import dataclass

from kvoffload_sidecar.file_layout import (
    FORMAT_VERSION,
    NS_HEADER_BYTES,
    NS_MAGIC,
    POOL_MAGIC,
    READABLE_VERSIONS,
    NamespaceLayout,
    PoolGeometry,
    decode_spec,
    header_digest,
    plan_namespace,
)
from kvoffload_sidecar.slot_table import SlotTable

# magic, version, max_namespaces, pool_size, partition_bytes, align, generation
_POOL_HDR = struct.Struct("<8sII QQQ 8s")
_POOL_CHECK_AT = 64  # the check follows the fields (8 bytes)
_BOOTS_AT = 128  # one u64 outside the check
_TENANTS_AT = 136  # one u64 outside the check: digest of the --tenants the codes refer to
# magic, version, key_size, num_ranks, record_bytes, partition, namespace_id, epoch,
# slot_bytes_per_rank, slot_count, per_rank_bytes, table_offset, spec_offset, spec_len
_NS_HDR = struct.Struct("<8sIIIII 16s QQQQQQQ")
_NS_CHECK_AT = 256


@dataclass(frozen=True)
class FoundHeader:
    """What the pool header says: `problem` is None when this sidecar can adopt the pool."""

    format_version: int  # 0: no header
    generation: str
    boots: int
    problem: str | None


def write_header(buf: mmap.mmap, geom: PoolGeometry, generation: str) -> None:
    """A new pool's header (generation: 16 hex characters); boots = 1."""
    off = geom.header_offset
    buf[off : off + 8] = bytes(8)  # invalid first: a torn write must not validate
    body = _POOL_HDR.pack(
        POOL_MAGIC,
        FORMAT_VERSION,
        geom.max_namespaces,
        geom.pool_size,
        geom.partition_bytes,
        geom.align,
        bytes.fromhex(generation),
    )
    buf[off + 8 : off + _POOL_HDR.size] = body[8:]
    buf[off + _POOL_CHECK_AT : off + _POOL_CHECK_AT + 8] = header_digest(body)
    struct.pack_into("<Q", buf, off + _BOOTS_AT, 1)
    buf[off : off + 8] = POOL_MAGIC


def read_header(buf: mmap.mmap, geom: PoolGeometry) -> FoundHeader:
    off = geom.header_offset
    if off < 0:
        return FoundHeader(0, "", 0, "the pool is smaller than its header")
    raw = bytes(buf[off : off + _POOL_HDR.size])
    magic, version, max_ns, size, part, align, gen = _POOL_HDR.unpack(raw)
    if magic != POOL_MAGIC:
        return FoundHeader(0, "", 0, "the file holds no pool index (or the pool size changed)")
    if version not in READABLE_VERSIONS:
        newer = "newer" if version > FORMAT_VERSION else "older"
        return FoundHeader(
            version,
            "",
            0,
            f"pool format v{version} is {newer} than this sidecar reads (v{FORMAT_VERSION})",
        )
    if bytes(buf[off + _POOL_CHECK_AT : off + _POOL_CHECK_AT + 8]) != header_digest(raw):
        return FoundHeader(version, "", 0, "the pool header is incomplete (torn write)")
    found = (size, max_ns, part, align)
    want = (geom.pool_size, geom.max_namespaces, geom.partition_bytes, geom.align)
    if found != want:
        return FoundHeader(
            version,
            gen.hex(),
            0,
            "the pool was built with other settings (size, partitions, alignment "
            f"{found} != {want})",
        )
    (boots,) = struct.unpack_from("<Q", buf, off + _BOOTS_AT)
    return FoundHeader(version, gen.hex(), boots, None)


def count_boot(buf: mmap.mmap, geom: PoolGeometry, boots: int) -> None:
    struct.pack_into("<Q", buf, geom.header_offset + _BOOTS_AT, boots)


def tenants_digest(names: str | None) -> int:
    """What the pool header records of the --tenants names (in order) the records' tenant
    codes index (0: none; format-1 writers left 0 there)."""
    if not names:
        return 0
    return int.from_bytes(hashlib.blake2b(names.encode(), digest_size=8).digest(), "little")


def read_tenants(buf: mmap.mmap, geom: PoolGeometry) -> int:
    (digest,) = struct.unpack_from("<Q", buf, geom.header_offset + _TENANTS_AT)
    return digest


def write_tenants(buf: mmap.mmap, geom: PoolGeometry, digest: int) -> None:
    """One aligned 8-byte store; written after the adopted records agree with it."""
    struct.pack_into("<Q", buf, geom.header_offset + _TENANTS_AT, digest)


def _ns_body(layout: NamespaceLayout) -> bytes:
    return _NS_HDR.pack(
        NS_MAGIC,
        FORMAT_VERSION,
        layout.spec.key_size,
        layout.num_ranks,
        layout.record_bytes,
        layout.partition,
        bytes.fromhex(layout.namespace_id),
        layout.epoch,
        layout.slot_bytes_per_rank,
        layout.slot_count,
        layout.per_rank_bytes,
        layout.table_offset,
        layout.spec_offset,
        len(layout.spec_json),
    )


def write_namespace(buf: mmap.mmap, layout: NamespaceLayout, generation: str) -> SlotTable:
    """Claim the partition for `layout`: header invalid, table cleared, spec, then the header
    and its check (valid only once complete). Returns the namespace's slot table."""
    h = layout.header_offset
    buf[h : h + 8] = bytes(8)
    table = SlotTable(buf, layout)
    table.clear()
    s = layout.spec_offset
    buf[s : s + len(layout.spec_json)] = layout.spec_json
    body = _ns_body(layout)
    buf[h + 8 : h + len(body)] = body[8:]
    check = header_digest(body, layout.spec_json, bytes.fromhex(generation))
    buf[h + _NS_CHECK_AT : h + _NS_CHECK_AT + 8] = check
    buf[h : h + 8] = NS_MAGIC
    return table


def read_namespace(
    buf: mmap.mmap, geom: PoolGeometry, partition: int, generation: str
) -> NamespaceLayout | str | None:
    """The namespace recorded in `partition`: its layout, None when the partition is empty, or
    why its record cannot be used."""
    h = (partition + 1) * geom.partition_bytes - NS_HEADER_BYTES
    if h < partition * geom.partition_bytes:
        return None  # partitions too small to hold a namespace
    raw = bytes(buf[h : h + _NS_HDR.size])
    (magic, version, key_size, num_ranks, rec, part, nid, epoch, slot_bytes, slot_count,
     per_rank, table_offset, spec_offset, spec_len) = _NS_HDR.unpack(raw)  # fmt: skip
    if magic != NS_MAGIC:
        return None
    if not (partition * geom.partition_bytes < spec_offset and spec_offset + spec_len <= h):
        return "its spec lies outside the partition"
    spec_json = bytes(buf[spec_offset : spec_offset + spec_len])
    check = header_digest(raw, spec_json, bytes.fromhex(generation))
    if bytes(buf[h + _NS_CHECK_AT : h + _NS_CHECK_AT + 8]) != check:
        return "its header is incomplete or from another pool generation"
    if version not in READABLE_VERSIONS or part != partition:
        return f"its header (v{version}, partition {part}) does not belong here"
    try:
        spec = decode_spec(spec_json)
        layout = plan_namespace(geom, partition, spec, num_ranks, slot_bytes, epoch=epoch)
    except (ValueError, TypeError, KeyError) as exc:
        return f"its spec cannot be read ({exc})"
    recorded = (nid.hex(), slot_count, per_rank, table_offset, rec, key_size)
    if layout is None or recorded != (
        layout.namespace_id,
        layout.slot_count,
        layout.per_rank_bytes,
        layout.table_offset,
        layout.record_bytes,
        layout.spec.key_size,
    ):
        return "its geometry differs from what its spec and the pool's settings give"
    return layout
