"""Staged-copy planning (pure numpy): cut a job into staging-buffer pieces and DMA runs.

The CUDA engine never moves scattered pieces across PCIe. A piece is up to ``capacity`` bytes
of whole GPU blocks of one group, packed in the staging buffer in slot format (block after block,
regions back to back), ordered by (slot, position in slot). On the GPU side a gather/scatter
kernel moves the regions between KV storage and staging at HBM speed; across PCIe the piece
moves as a few large DMA runs: maximal ranges contiguous both in the pool and in staging, cut
where a run would cross a ``cudaHostRegister`` piece of the pool.

``JobPlan`` (what the engine uses) and ``plan_pieces`` (the eager reference, same pieces) differ
only in when the work is done: ``JobPlan`` sorts each batch and cuts it into pieces up front
(vectorised), but builds DMA runs for piece 0 alone first and for the rest of the job in one
vectorised pass when piece 1 is asked for, so the first copy is queued while most of a large
job is still unplanned.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvoffload_connector.worker.transfer.contract import TransferBatch

__all__ = ["JobPlan", "Piece", "plan_pieces"]


@dataclass(frozen=True, eq=False)
class Piece:
    """One staging-buffer load of one group."""

    group: int
    gpu_blocks: np.ndarray  # int64 [m]: block i of the piece sits at staging[i * block_bytes]
    runs: np.ndarray  # int64 [k, 3]: (pool byte offset from slot 0, staging byte offset, bytes)

    @property
    def nbytes(self) -> int:
        return int(self.runs[:, 2].sum())


def plan_pieces(
    batches: Sequence[TransferBatch],
    group_block_bytes: dict[int, int],
    slot_bytes: int,
    capacity: int,
    register_piece_bytes: int,
    head: int = 0,
    tail: int = 0,
) -> list[Piece]:
    """Pieces for ``batches`` (already validated). ``capacity`` >= every group's block bytes.

    ``head``/``tail`` (bytes, 0 = off) cap the first/last piece of each batch: a small first
    STORE piece starts PCIe after a short gather, a small last LOAD piece ends the job soon
    after its last DMA (pipeline fill and drain).
    """
    pieces: list[Piece] = []
    for b in batches:
        n = len(b)
        if n == 0:
            continue
        gbb = group_block_bytes[b.group]
        if gbb > capacity:
            raise ValueError(f"staging capacity {capacity} < block bytes {gbb}")
        order = np.lexsort((b.slot_block_index, b.slots))
        blocks = b.gpu_blocks[order]
        pool_off = b.slots[order] * slot_bytes + b.slot_block_index[order] * gbb
        per = capacity // gbb
        cuts = _piece_starts(
            n,
            per,
            max(1, min(head, capacity) // gbb) if head else 0,
            max(1, min(tail, capacity) // gbb) if tail else 0,
        )
        piece_of = np.searchsorted(cuts, np.arange(n), side="right") - 1
        first_of = cuts[piece_of]  # index of each block's piece's first block
        brk = np.ones(n, dtype=bool)  # True where a new DMA run starts
        brk[1:] = ~(
            (pool_off[1:] == pool_off[:-1] + gbb)
            & (pool_off[1:] // register_piece_bytes == pool_off[:-1] // register_piece_bytes)
            & (piece_of[1:] == piece_of[:-1])
        )
        starts = np.flatnonzero(brk)
        lengths = np.diff(np.append(starts, n))
        stg = (starts - first_of[starts]) * gbb
        runs = np.stack([pool_off[starts], stg, lengths * gbb], axis=1)
        bounds = np.searchsorted(piece_of[starts], np.arange(len(cuts) + 1))
        ends = np.append(cuts[1:], n)
        for k in range(len(cuts)):
            pieces.append(
                Piece(b.group, blocks[cuts[k] : ends[k]], runs[bounds[k] : bounds[k + 1]])
            )
    return pieces


class JobPlan:
    """The pieces of one validated job, in the order ``plan_pieces`` returns them.

    Contract: ``ids`` holds every piece's GPU block ids back to back (piece ``i`` at
    ``ids[ids_at[i]:ids_at[i + 1]]``), known before any run list is built, so the engine can
    upload them once; ``piece(i)`` / iteration give ``Piece`` objects equal to
    ``plan_pieces(...)[i]``. Not thread-safe (one submit owns it).
    """

    def __init__(
        self,
        batches: Sequence[TransferBatch],
        group_block_bytes: dict[int, int],
        slot_bytes: int,
        capacity: int,
        register_piece_bytes: int,
        head: int = 0,
        tail: int = 0,
    ) -> None:
        self._reg = register_piece_bytes
        # per non-empty batch: (group, block bytes, sorted blocks, sorted pool offsets, cuts)
        self._parts: list[tuple[int, int, np.ndarray, np.ndarray, np.ndarray]] = []
        index: list[tuple[int, int]] = []  # piece -> (part, k)
        ids, counts = [], []
        for b in batches:
            n = len(b)
            if n == 0:
                continue
            gbb = group_block_bytes[b.group]
            if gbb > capacity:
                raise ValueError(f"staging capacity {capacity} < block bytes {gbb}")
            # (slot, position) order == pool offset order: position * gbb < slot_bytes;
            # stable, like plan_pieces' lexsort, for LOADs reading one position twice
            pool_off = b.slots * slot_bytes + b.slot_block_index * gbb
            order = np.argsort(pool_off, kind="stable")
            blocks = b.gpu_blocks[order]
            cuts = _piece_starts(
                n,
                capacity // gbb,
                max(1, min(head, capacity) // gbb) if head else 0,
                max(1, min(tail, capacity) // gbb) if tail else 0,
            )
            index.extend((len(self._parts), k) for k in range(len(cuts)))
            self._parts.append((b.group, gbb, blocks, pool_off[order], cuts))
            ids.append(blocks)
            counts.append(np.diff(np.append(cuts, n)))
        self._index = index
        self._cache: dict[int, Piece] = {}
        self.ids = ids[0] if len(ids) == 1 else np.concatenate([np.empty(0, np.int64), *ids])
        self.ids_at = np.concatenate([[0], *counts]).astype(np.int64).cumsum()

    def __len__(self) -> int:
        return len(self._index)

    def __iter__(self) -> Iterator[Piece]:
        for i in range(len(self._index)):
            yield self.piece(i)

    def piece(self, i: int) -> Piece:
        """Piece ``i``; piece 0 is planned alone, any other plans every piece not yet built."""
        got = self._cache.get(i)
        if got is not None:
            return got
        if i == 0:
            self._cache[0] = self._first()
        else:
            at = 1 if 0 in self._cache else 0
            while at < len(self._index):
                part, k = self._index[at]
                built = self._plan(part, k, len(self._parts[part][4]))
                for piece in built:
                    self._cache[at] = piece
                    at += 1
        return self._cache[i]

    def _first(self) -> Piece:
        """Piece 0 alone: ``_plan`` for one piece, with the piece bookkeeping left out (the
        ops here are what stands between ``submit()`` and the first DMA)."""
        group, gbb, blocks, pool_all, cuts = self._parts[0]
        e = int(cuts[1]) if len(cuts) > 1 else len(blocks)
        po = pool_all[:e]
        brk = np.ones(e, dtype=bool)
        nxt, prev = po[1:], po[:-1]
        brk[1:] = (nxt != prev + gbb) | (nxt // self._reg != prev // self._reg)
        starts = np.flatnonzero(brk)
        lengths = np.diff(starts, append=e)
        runs = np.stack([po[starts], starts * gbb, lengths * gbb], axis=1)
        return Piece(group, blocks[:e], runs)

    def _plan(self, part: int, k0: int, k1: int) -> list[Piece]:
        """Pieces ``k0 .. k1-1`` of one batch, vectorised (plan_pieces' logic on a slice)."""
        group, gbb, blocks, pool_all, cuts_all = self._parts[part]
        n_all = len(blocks)
        s = int(cuts_all[k0])
        e = int(cuts_all[k1]) if k1 < len(cuts_all) else n_all
        pool_off = pool_all[s:e]
        n = e - s
        cuts = cuts_all[k0:k1] - s
        piece_of = np.searchsorted(cuts, np.arange(n), side="right") - 1
        reg = self._reg
        brk = np.ones(n, dtype=bool)
        brk[1:] = ~(
            (pool_off[1:] == pool_off[:-1] + gbb)
            & (pool_off[1:] // reg == pool_off[:-1] // reg)
            & (piece_of[1:] == piece_of[:-1])
        )
        starts = np.flatnonzero(brk)
        lengths = np.diff(np.append(starts, n))
        stg = (starts - cuts[piece_of[starts]]) * gbb
        runs = np.stack([pool_off[starts], stg, lengths * gbb], axis=1)
        bounds = np.searchsorted(piece_of[starts], np.arange(len(cuts) + 1))
        ends = np.append(cuts[1:], n)
        return [
            Piece(group, blocks[s + cuts[j] : s + ends[j]], runs[bounds[j] : bounds[j + 1]])
            for j in range(len(cuts))
        ]


def _piece_starts(n: int, per: int, head: int, tail: int) -> np.ndarray:
    """First block index of each piece: ``head`` blocks, then ``per`` each, the last piece
    split so that it holds at most ``tail`` blocks."""
    first = min(head, n) if head else min(per, n)
    starts = np.concatenate([[0], np.arange(first, n, per, dtype=np.int64)]).astype(np.int64)
    if tail and n - starts[-1] > tail:
        starts = np.append(starts, n - tail)
    return starts
