"""The pool file's own index: what a restarted sidecar reads to adopt the pool instead of
starting empty. Pure layout and record logic over the mapped file; no locks, no grpc.

Layout (little-endian, all in `pool-0.shm`, so index and bytes can never come apart):

    [ partition 0 | partition 1 | ... | partition n-1 | (unused) | pool header (4 KiB) ]
    partition: [ rank 0 region | rank 1 region | ... | slot table | spec | namespace header ]

- **Pool header** (last 4 KiB of the file): magic, format version, pool size, partition count
  and size, generation, a blake2b check. Written once when the pool is created, never in place
  afterwards (a torn rewrite would lose the pool); `boots` sits beside it, outside the check,
  as one aligned 8-byte store.
- **Namespace header** (last 4 KiB of its partition) + its spec (JSON) below it: id, epoch (random
  per namespace creation), geometry, where its slot table is; checked with blake2b over the
  header, the spec and the pool's generation, so after a discard (new generation) no old
  namespace validates.
- **Slot table**: one record per slot, `[state][check][last use][key, padded to 8 bytes]` as
  64-bit words. state 0 = free, 1 = reserved (a store may be writing its bytes; `check` then holds
  when, wall clock ms, and `last use` the engine that owns the reservation, engine_locks.py),
  >= 2 = committed, the value being the commit's sequence number, unique over the file's life
  (a slot's *version*: a load compares it before and after its copy). `check` is
  a 64-bit mix of (epoch, slot, state, key). `last use` is the pool's sequence counter at the
  block's last hit (lookups and pins write it, outside the check): the adopter rebuilds the LRU
  order from it, so a hot prefix is not the first victim after a restart. Its top 8 bits hold
  the tenant that stored the block (`--tenants`: its index + 1; 0, as every format-1 writer
  left it, means not recorded: the default tenant), kept by every touch, so per-tenant quotas
  survive a restart too.

Why this is crash-consistent (the process dies; the tmpfs pages stay):
- A slot becomes `reserved` (one 8-byte store) before the reservation's answer leaves the
  sidecar, so before any byte of a new block is written: a committed record never describes
  bytes being overwritten.
- The commit record is written after every rank reported its copy complete; key and check
  first, the state word last. A record torn by the kill fails the check (a collision of the
  64-bit mix is ~2^-64) and is never served.
- Eviction writes nothing: the record and bytes stay intact until the slot is reserved again, so
  a block evicted just before a kill may come back; when its key was stored again elsewhere the
  higher sequence number wins.
- Reservations and pins of dead processes are not in the file (pins) or marked reserved
  (reservations, with their owning engine): the adopter withholds a slot reserved at death
  until that engine is dead (its workers' file locks are gone), so no late copy of it can land
  in a slot given to another store. A torn reservation (state word not yet reserved) was never
  answered: nobody writes it, and it is free.
- Versions: a writer changes a slot's bytes only after the sidecar changed its state word
  (reserved, before the answer), and every commit writes a sequence number above every state
  word in the file: a load whose slot reads the same state word after its copy as when it was
  pinned copied bytes that no store touched in between.
Adoption reads only this index (numpy over the table): its cost grows with slots, not bytes.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from itertools import repeat

import numpy as np

from kvoffload_sidecar.host import HUGE_PAGE_BYTES
from kvoffload_sidecar.keys import NamespaceId, NamespaceSpec, derive_namespace
from kvoffload_sidecar.units import align_down, align_up

__all__ = [
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "Adoption",
    "FoundHeader",
    "NamespaceLayout",
    "PoolGeometry",
    "SlotTable",
    "TableScan",
    "geometry",
    "plan_namespace",
    "read_header",
    "read_namespace",
    "write_header",
    "write_namespace",
]

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

# magic, version, max_namespaces, pool_size, partition_bytes, align, generation
_POOL_HDR = struct.Struct("<8sII QQQ 8s")
_POOL_CHECK_AT = 64  # the check follows the fields (8 bytes)
_BOOTS_AT = 128  # one u64 outside the check
_TENANTS_AT = 136  # one u64 outside the check: digest of the --tenants the codes refer to
# magic, version, key_size, num_ranks, record_bytes, partition, namespace_id, epoch,
# slot_bytes_per_rank, slot_count, per_rank_bytes, table_offset, spec_offset, spec_len
_NS_HDR = struct.Struct("<8sIIIII 16s QQQQQQQ")
_NS_CHECK_AT = 256


def _digest(*parts: bytes) -> bytes:
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


# -- pool header --------------------------------------------------------------------------------


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
    buf[off + _POOL_CHECK_AT : off + _POOL_CHECK_AT + 8] = _digest(body)
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
    if bytes(buf[off + _POOL_CHECK_AT : off + _POOL_CHECK_AT + 8]) != _digest(raw):
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


# -- namespace headers --------------------------------------------------------------------------


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
    check = _digest(body, layout.spec_json, bytes.fromhex(generation))
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
    check = _digest(raw, spec_json, bytes.fromhex(generation))
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


# -- slot records -------------------------------------------------------------------------------

_MUL = np.uint64(0x9E3779B97F4A7C15)
_FIN = np.uint64(0xC2B2AE3D27D4EB4F)
_S31, _S29, _S32 = np.uint64(31), np.uint64(29), np.uint64(32)


_MASK = (1 << 64) - 1
_SEED = 0x6B766F66666C6F61
SCALAR_MAX = 8  # commits and marks of at most this many records skip numpy (per-call overhead)


def record_check_one(epoch: int, slot: int, state: int, key_words: tuple[int, ...]) -> int:
    """`record_check` of one record with Python ints (same mix, same result)."""
    h = (epoch ^ _SEED) & _MASK
    for w in (slot, state, *key_words):
        h = ((h ^ w) * 0x9E3779B97F4A7C15) & _MASK
        h ^= h >> 31
    h = (h * 0xC2B2AE3D27D4EB4F) & _MASK
    return h ^ (h >> 32)


def record_check(epoch: int, slots: np.ndarray, states: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """The 64-bit check of records (one per row of `keys`, uint64 words): a multiply-xorshift
    mix of epoch, slot, state and every key word, vectorised over the records."""
    h = np.full(len(slots), np.uint64(epoch ^ _SEED), np.uint64)
    words = [slots.astype(np.uint64, copy=False), states.astype(np.uint64, copy=False)]
    words += [keys[:, j] for j in range(keys.shape[1])]
    for w in words:
        h ^= w
        h *= _MUL
        h ^= h >> _S31
    h *= _FIN
    h ^= h >> _S32
    return h


@dataclass
class TableScan:
    """What a slot table holds: the blocks to adopt (oldest commit first) and what is not."""

    slots: np.ndarray  # intp, committed slots to adopt, in commit order
    packed: bytes  # their keys, back to back, same order
    max_seq: int
    withheld: np.ndarray  # intp: reserved at death (a late copy of its owner may land)
    withheld_owners: np.ndarray  # uint64 per withheld slot: the engine owning the reservation
    discarded: dict[str, int] = field(default_factory=dict)
    # uint8 per adopted slot (same order): tenant index + 1 that stored it, 0 when not recorded
    tenants: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))


class SlotTable:
    """The records of one namespace: a uint64 view into the mapped file."""

    def __init__(self, buf: mmap.mmap, layout: NamespaceLayout) -> None:
        self.layout = layout
        self._buf = buf
        self._row = struct.Struct(f"<{layout.record_bytes // 8 - 1}Q")  # check, touch, key
        self._key_pad = bytes(layout.record_bytes - 24 - layout.spec.key_size)
        self.key_size = layout.spec.key_size
        self.key_words = (layout.record_bytes - 24) // 8
        self.epoch = layout.epoch
        words = layout.record_bytes // 8
        self.words = np.frombuffer(
            buf, np.uint64, layout.slot_count * words, layout.table_offset
        ).reshape(layout.slot_count, words)
        self.state = self.words[:, 0]

    def clear(self) -> None:
        self.words[:] = 0

    def mark(
        self, slots: np.ndarray | list[int], state: int, when_ms: int = 0, owner: int = 0
    ) -> None:
        """Reserved (before the reservation is answered: `owner`, the engine owning it, goes in
        the last-use word, `when_ms` in the check word, the state word last) or free (an
        aborted store or a reclaimed reservation)."""
        n = len(slots)
        if n > SCALAR_MAX:
            idx = np.asarray(slots, np.intp)
            self.words[idx, 2] = owner
            self.words[idx, 1] = when_ms
            self.state[idx] = state
        elif n:
            column, checks, owners = self.state, self.words[:, 1], self.words[:, 2]
            for slot in slots:
                owners[slot] = owner
                checks[slot] = when_ms
                column[slot] = state

    def versions(self, slots: np.ndarray | Sequence[int]) -> np.ndarray:
        """The state words of `slots` (uint64): a committed slot's version."""
        return self.state[np.asarray(slots, np.intp)]

    def commit(
        self,
        slots: np.ndarray | list[int],
        packed: bytes,
        seq: int,
        tenants: int | Sequence[int] = 0,
    ) -> None:
        """Commit records for `slots` holding the packed keys (same order): key and check
        first, the state word last. `tenants`: the code (tenant index + 1, 0: none) of all of
        them, or one per slot."""
        n = len(slots)
        if not n:
            return
        if n <= SCALAR_MAX:
            self._commit_few(slots, packed, seq, tenants)
            return
        idx = np.asarray(slots, np.intp)
        keys = np.zeros((n, self.key_words * 8), np.uint8)
        keys[:, : self.key_size] = np.frombuffer(packed, np.uint8, n * self.key_size).reshape(
            n, self.key_size
        )
        kw = keys.view(np.uint64)
        states = np.full(n, seq, np.uint64)
        rows = self.words
        rows[idx, 3:] = kw
        codes = np.asarray(tenants, np.uint64) << np.uint64(TENANT_SHIFT)
        rows[idx, 2] = states | codes  # last use: the commit, and who stored it
        rows[idx, 1] = record_check(self.epoch, idx, states, kw)
        rows[idx, 0] = states

    def _commit_few(
        self, slots: np.ndarray | list[int], packed: bytes, seq: int, tenants: int | Sequence[int]
    ) -> None:
        """`commit` for a few records: Python ints and struct, no numpy call per record."""
        ks, base, size = self.key_size, self.layout.table_offset, self.layout.record_bytes
        words = self.key_words
        unpack = struct.Struct(f"<{words}Q").unpack
        codes = repeat(tenants) if isinstance(tenants, int) else iter(tenants)
        for i, slot in enumerate(map(int, slots)):
            key = unpack(packed[i * ks : (i + 1) * ks] + self._key_pad)
            at = base + slot * size
            check = record_check_one(self.epoch, slot, seq, key)
            use = seq | (int(next(codes)) << TENANT_SHIFT)
            self._row.pack_into(self._buf, at + 8, check, use, *key)
            self.state[slot] = seq  # the state word last

    def touch(self, slots: np.ndarray | list[int] | tuple[int, ...], when: int) -> None:
        """Record a use (hit) of committed slots: an adopter orders the LRU by it. Outside the
        check (a torn touch only misorders one block), one aligned 8-byte store each; the
        tenant bits stay."""
        n = len(slots)
        if n > SCALAR_MAX:
            idx = np.asarray(slots, np.intp)
            column = self.words[:, 2]
            column[idx] = (column[idx] & TENANT_BITS) | np.uint64(when)
        elif n:
            column = self.words[:, 2]
            for slot in slots:
                column[slot] = (int(column[slot]) & ~int(USE_MASK)) | when

    def forget_tenants(self, slots: np.ndarray) -> None:
        """Clear the tenant codes of `slots` (they indexed another --tenants configuration)."""
        if len(slots):
            idx = np.asarray(slots, np.intp)
            self.words[idx, 2] &= USE_MASK

    def scan(self) -> TableScan:
        """Read every record: the valid commits (a key stored twice keeps its latest), the slots
        to withhold (reserved at death, with their owners), the discards by reason."""
        state = np.array(self.state)  # one copy: the checks below read a stable snapshot
        cand = np.flatnonzero(state >= FIRST_SEQ)
        reserved = np.flatnonzero(state == RESERVED)
        owners = self.words[reserved, 2].copy()
        discarded: dict[str, int] = {}
        if len(reserved):
            discarded["reserved"] = len(reserved)
        # every later commit numbers above every state word here: no slot's version repeats
        top = int(state.max()) if len(state) else 0
        if not len(cand):
            return TableScan(np.zeros(0, np.intp), b"", top, reserved, owners, discarded)
        rows = self.words[cand]
        ok = record_check(self.epoch, cand, state[cand], rows[:, 3:]) == rows[:, 1]
        torn = cand[~ok]
        if len(torn):  # a reservation's mark cut short: never answered, so nobody writes it
            discarded["torn"] = len(torn)
        good, rows = cand[ok], rows[ok]
        seqs = state[good]
        used = np.maximum(rows[:, 2] & USE_MASK, seqs)  # last use: a hit's touch, else the commit
        codes = (rows[:, 2] >> np.uint64(TENANT_SHIFT)).astype(np.uint8)
        keys = np.ascontiguousarray(rows[:, 3:]).view(np.uint8)[:, : self.key_size]
        keep = _latest_per_key(keys, seqs)
        if len(keep) < len(good):
            discarded["duplicate"] = len(good) - len(keep)
        keep = keep[np.argsort(used[keep], kind="stable")]  # least recently used first
        return TableScan(
            slots=good[keep],
            packed=np.ascontiguousarray(keys[keep]).tobytes(),
            max_seq=max(top, int(used.max()) if len(used) else 0),
            withheld=reserved,
            withheld_owners=owners,
            discarded=discarded,
            tenants=codes[keep],
        )


def _latest_per_key(keys: np.ndarray, seqs: np.ndarray) -> np.ndarray:
    """Row indices keeping, for each distinct key, its row with the highest seq. Sorting on
    the first 8 key bytes finds candidate repeats at numpy speed; only rows sharing those are
    compared whole (a repeat is rare: an evicted block stored again before the kill)."""
    n = len(keys)
    if n < 2:
        return np.arange(n)
    head = np.zeros((n, 8), np.uint8)
    width = min(8, keys.shape[1])
    head[:, :width] = keys[:, :width]
    first = head.view(np.uint64).ravel()
    order = np.argsort(first, kind="stable")
    sorted_first = first[order]
    same = sorted_first[1:] == sorted_first[:-1]
    if not same.any():
        return np.arange(n)
    drop: set[int] = set()
    best: dict[bytes, int] = {}
    flagged = np.zeros(n, bool)
    flagged[1:] |= same
    flagged[:-1] |= same
    for i in order[flagged].tolist():
        key = keys[i].tobytes()
        j = best.get(key)
        if j is None:
            best[key] = i
        elif seqs[i] > seqs[j]:
            drop.add(j)
            best[key] = i
        else:
            drop.add(i)
    if not drop:
        return np.arange(n)
    mask = np.ones(n, bool)
    mask[list(drop)] = False
    return np.flatnonzero(mask)


@dataclass
class Adoption:
    """What this sidecar found in the pool file at start (Stats.adoption)."""

    outcome: str = "new"  # "new" | "adopted" | "discarded"
    reason: str = ""
    format_version: int = 0
    adopted_blocks: int = 0
    adopted_namespaces: int = 0
    discarded: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    boots: int = 1

    def add_discards(self, counts: dict[str, int]) -> None:
        for reason, n in counts.items():
            self.discarded[reason] = self.discarded.get(reason, 0) + n
