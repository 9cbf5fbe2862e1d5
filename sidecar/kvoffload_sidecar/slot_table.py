"""The slot records of one namespace in the pool file (`SlotTable`: a uint64 view into the
mapped file) and their check; what an adopter reads back (`TableScan`)."""

from __future__ import annotations

import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat

import numpy as np

from kvoffload_sidecar.file_layout import (
    FIRST_SEQ,
    RESERVED,
    TENANT_BITS,
    TENANT_SHIFT,
    USE_MASK,
    NamespaceLayout,
)

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
