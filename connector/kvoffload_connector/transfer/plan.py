"""Staged-copy planning (pure numpy): cut a job into staging-buffer pieces and DMA runs.

The CUDA engine never moves scattered pieces across PCIe. A piece is up to ``capacity`` bytes
of whole GPU blocks of one group, packed in the staging buffer in slot format (block after block,
regions back to back), ordered by (slot, position in slot). On the GPU side a gather/scatter
kernel moves the regions between KV storage and staging at HBM speed; across PCIe the piece
moves as a few large DMA runs: maximal ranges contiguous both in the pool and in staging, cut
where a run would cross a ``cudaHostRegister`` piece of the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvoffload_connector.transfer.engine import TransferBatch

__all__ = ["Piece", "plan_pieces"]


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


def _piece_starts(n: int, per: int, head: int, tail: int) -> np.ndarray:
    """First block index of each piece: ``head`` blocks, then ``per`` each, the last piece
    split so that it holds at most ``tail`` blocks."""
    starts = [0]
    at = min(head, n) if head else min(per, n)
    while at < n:
        starts.append(at)
        at += per
    if tail and n - starts[-1] > tail:
        starts.append(n - tail)
    return np.array(starts, dtype=np.int64)
