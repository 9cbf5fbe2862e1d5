"""The pool file's own index: what a restarted sidecar reads to adopt the pool instead of
starting empty. Pure layout and record logic over the mapped file; no locks, no grpc. This
module is the format's one name for the pool (`persist.X`) and says what a start found
(`Adoption`); the code is in file_layout.py (where each part lives), file_headers.py (the pool
and namespace headers) and slot_table.py (the slot records).

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

from dataclasses import dataclass, field

from kvoffload_sidecar.file_headers import (
    FoundHeader,
    count_boot,
    read_header,
    read_namespace,
    read_tenants,
    tenants_digest,
    write_header,
    write_namespace,
    write_tenants,
)
from kvoffload_sidecar.file_layout import (
    FIRST_SEQ,
    FORMAT_VERSION,
    FREE,
    HEADER_BYTES,
    MAX_SLOTS,
    RESERVED,
    NamespaceLayout,
    PoolGeometry,
    decode_spec,
    encode_spec,
    geometry,
    plan_namespace,
    record_bytes,
)
from kvoffload_sidecar.slot_table import (
    SCALAR_MAX,
    SlotTable,
    TableScan,
    record_check,
    record_check_one,
)

__all__ = [
    "FIRST_SEQ",
    "FORMAT_VERSION",
    "FREE",
    "HEADER_BYTES",
    "MAX_SLOTS",
    "RESERVED",
    "SCALAR_MAX",
    "Adoption",
    "FoundHeader",
    "NamespaceLayout",
    "PoolGeometry",
    "SlotTable",
    "TableScan",
    "count_boot",
    "decode_spec",
    "encode_spec",
    "geometry",
    "plan_namespace",
    "read_header",
    "read_namespace",
    "read_tenants",
    "record_bytes",
    "record_check",
    "record_check_one",
    "tenants_digest",
    "write_header",
    "write_namespace",
    "write_tenants",
]


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
