"""vLLM KV-cache tensors -> a canonical, per-group description of where each GPU block's bytes live.

Pure: torch is used for shapes, strides and views only (no copies). The result tells the transfer
engines, for every KV group, the contiguous pieces ("regions") that make up one GPU block, so that
any layout vLLM hands over (layer-major ``LBHNC``, block-major ``BLHNC``, K/V packed in one page or
split in two, padded pages, kernel-block splitting, several groups, tensors shared by several
layers) reduces to one list of ``(storage, offset, block_stride, block_bytes)``.

Pool slot layout (the contract with the pool): a slot holds ``chunk_blocks`` GPU blocks of ONE
group, block-major: block ``i`` of the chunk at ``[i * group.block_bytes, (i + 1) *
group.block_bytes)``, its regions back to back in region order. Regions are ordered by
(storage in first-seen order, byte offset), and neighbours that touch are merged; because vLLM
places the layers of a ``KVCacheTensor`` in layer order in both layer-major and block-major
layouts, a block's slot bytes are the layers' pages in layer order either way.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["CanonicalLayout", "GroupLayout", "Region", "canonicalize"]

SLOT_ALIGN = 16  # bytes; slots start 16-byte aligned so copy kernels can use 16-byte vectors


@dataclass(frozen=True)
class Region:
    """One contiguous piece of every GPU block of a KV group."""

    storage: int  # index into CanonicalLayout.storages
    offset: int  # bytes from the storage start to block 0's piece
    block_stride: int  # bytes between block b's piece and block b+1's
    block_bytes: int  # bytes in the piece


@dataclass(frozen=True)
class GroupLayout:
    """The regions of one KV group; a GPU block of this group is these pieces, in this order."""

    group_id: int
    regions: tuple[Region, ...]  # deduplicated, merged where contiguous, stable order
    num_blocks: int

    @property
    def block_bytes(self) -> int:
        """Bytes of one GPU block of this group inside a pool slot."""
        return sum(r.block_bytes for r in self.regions)

    def region_offsets(self) -> tuple[int, ...]:
        """Offset of each region inside one block's bytes in a slot."""
        return tuple(itertools.accumulate((r.block_bytes for r in self.regions[:-1]), initial=0))


@dataclass(frozen=True, eq=False)
class CanonicalLayout:
    """Everything an engine needs to move blocks of any group between GPU and pool slots."""

    storages: tuple[torch.Tensor, ...]  # flat uint8 views of the backing allocations
    groups: tuple[GroupLayout, ...]
    chunk_blocks: int  # GPU blocks per pool slot
    tag: str  # short description of the byte format; goes into the namespace spec
    # Per layer, in forward order: (layer name, group id, indices of the group's regions that
    # hold its bytes). Regions merged across layers (block-major layouts) list every layer
    # sharing them. Layer-by-layer loads use it; empty when unknown.
    layers: tuple[tuple[str, int, tuple[int, ...]], ...] = ()

    @property
    def slot_bytes(self) -> int:
        """Bytes of one pool slot: chunk_blocks of the largest group, rounded up to 16."""
        raw = self.chunk_blocks * max(g.block_bytes for g in self.groups)
        return -(-raw // SLOT_ALIGN) * SLOT_ALIGN

    def group(self, group_id: int) -> GroupLayout:
        """The group with this id; KeyError when unknown."""
        for g in self.groups:
            if g.group_id == group_id:
                return g
        raise KeyError(f"no KV group {group_id} in layout {self.tag!r}")


@dataclass(frozen=True)
class _Piece:
    """A region before storages are numbered: keyed by the storage's data pointer."""

    storage_ptr: int
    offset: int
    block_stride: int
    block_bytes: int


def canonicalize(
    kv_caches: Mapping[str, torch.Tensor],
    layer_groups: Mapping[str, int],
    chunk_blocks: int,
    kv_cache_config: object | None = None,
) -> CanonicalLayout:
    """Describe ``kv_caches`` (layer name -> tensor as vLLM registers it) per KV group.

    ``layer_groups`` maps every layer name to its KV group id. ``kv_cache_config`` (vLLM's
    ``KVCacheConfig``), when given, supplies ``num_blocks`` so kernel-block splitting
    (``[B * r, H, N, C]`` views) and ambiguous shapes resolve. Accepted per-layer shapes:
    ``[B, H, N, C]`` (vLLM >= 0.26, K/V packed in C, any stride order, padded pages),
    ``[2, B, ...]`` (K/V split, older backends), ``[B, 2, ...]`` and block-outermost cross-layer
    tensors ``[B, L, ...]``. Anything else raises ValueError naming the layer and shape.
    """
    if chunk_blocks < 1:
        raise ValueError(f"chunk_blocks must be >= 1, got {chunk_blocks}")
    if not kv_caches:
        raise ValueError("kv_caches is empty: nothing to describe")
    missing = [name for name in kv_caches if name not in layer_groups]
    if missing:
        raise ValueError(f"layers without a KV group in layer_groups: {missing[:5]}")
    config_blocks = _config_num_blocks(kv_cache_config)

    storage_order: dict[tuple[str, int], int] = {}
    storage_tensors: list[torch.Tensor] = []
    pieces: dict[int, list[_Piece]] = {}
    layer_pieces_of: dict[str, list[_Piece]] = {}
    num_blocks: dict[int, int] = {}
    kv_kinds: set[str] = set()
    entries: dict[int, dict[tuple[int, int], tuple[int, Any]]] = {}  # per group, deduped views
    block_major = False
    for name, tensor in kv_caches.items():
        gid = int(layer_groups[name])
        view, kind = _blocks_first(name, tensor, config_blocks)
        nb = view.shape[0]
        if num_blocks.setdefault(gid, nb) != nb:
            raise ValueError(
                f"layer {name!r} has {nb} blocks but group {gid} has {num_blocks[gid]}"
            )
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if key not in storage_order:
            storage_order[key] = len(storage_tensors)
            storage_tensors.append(_flat_bytes(tensor))
        layer_pieces = _pieces_of(name, view, storage.data_ptr(), storage.nbytes())
        pieces.setdefault(gid, []).extend(layer_pieces)
        layer_pieces_of[name] = layer_pieces
        kv_kinds.add(kind)
        ekey = (view.data_ptr(), hash((tuple(view.shape), tuple(view.stride()))))
        entries.setdefault(gid, {}).setdefault(
            ekey, (storage_order[key], view, view.data_ptr() - storage.data_ptr())
        )
        block_major |= kind == "crosslayer"

    groups = []
    for gid in sorted(pieces):
        regions = _merge(pieces[gid], storage_order, storage_tensors)
        block_major |= _interleaved(pieces[gid])
        groups.append(GroupLayout(group_id=gid, regions=regions, num_blocks=num_blocks[gid]))
    kv = "+".join(sorted(kv_kinds))
    fmt = _format_digest([list(entries[gid].values()) for gid in sorted(entries)])
    tag = f"{'BL' if block_major else 'LB'}/{kv}/{len(groups)}g/{fmt}"
    ptr_index = {ptr: idx for (_, ptr), idx in storage_order.items()}
    layers = tuple(
        (name, int(layer_groups[name]), _regions_holding(groups, layer_groups[name], ps, ptr_index))
        for name, ps in sorted(layer_pieces_of.items(), key=lambda kv: _natural_key(kv[0]))
    )
    return CanonicalLayout(
        storages=tuple(storage_tensors),
        groups=tuple(groups),
        chunk_blocks=chunk_blocks,
        tag=tag,
        layers=layers,
    )


def _natural_key(name: str) -> tuple:
    """Sort key putting "layers.10" after "layers.9" (vLLM's forward order of layer names)."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def _regions_holding(
    groups: list[GroupLayout], gid: int, pieces: list[_Piece], ptr_index: Mapping[int, int]
) -> tuple[int, ...]:
    """Indices of group ``gid``'s regions that contain one of a layer's pieces."""
    regions = next(g.regions for g in groups if g.group_id == gid)
    found = set()
    for p in pieces:
        sidx = ptr_index[p.storage_ptr]
        for i, r in enumerate(regions):
            if r.storage == sidx and r.offset <= p.offset < r.offset + r.block_bytes:
                found.add(i)
                break
    return tuple(sorted(found))


def _config_num_blocks(kv_cache_config: object | None) -> int | None:
    if kv_cache_config is None:
        return None
    nb = getattr(kv_cache_config, "num_blocks", None)
    if not isinstance(nb, int) or nb < 1:
        raise ValueError(f"kv_cache_config.num_blocks must be a positive int, got {nb!r}")
    return nb


def _blocks_first(name: str, t: torch.Tensor, config_blocks: int | None) -> tuple[Any, str]:
    """A view of ``t`` whose dim 0 is the manager block, and the K/V arrangement it implies."""
    shape = tuple(t.shape)
    if t.ndim < 3 or t.numel() == 0:
        raise ValueError(f"layer {name!r}: unsupported KV cache shape {shape}")
    if any(s == 0 for s, n in zip(t.stride(), shape, strict=True) if n > 1):
        raise ValueError(f"layer {name!r}: broadcast (stride 0) KV cache tensor {shape}")
    if config_blocks is not None:
        nb = config_blocks
        if shape[0] == 2 and shape[1] == nb and nb != 2:
            return t.transpose(0, 1), "kvsplit"
        if shape[0] % nb == 0:
            ratio = shape[0] // nb  # kernel-block splitting: r kernel blocks per manager block
            view = t if ratio == 1 else t.unflatten(0, (nb, ratio))
            kind = "kvpacked" if t.ndim == 4 else "kvsplit" if shape[1] == 2 else "crosslayer"
            return view, kind
        raise ValueError(f"layer {name!r}: KV cache shape {shape} has no block dim of {nb} blocks")
    if t.ndim == 4:
        return t, "kvpacked"  # [B, H, N, C], K and V packed in C (vLLM >= 0.26)
    if shape[0] == 2 and shape[1] == 2:
        raise ValueError(
            f"layer {name!r}: KV cache shape {shape} is ambiguous; pass kv_cache_config"
        )
    if shape[0] == 2:
        return t.transpose(0, 1), "kvsplit"  # [2, B, ...]: K and V pages apart
    if shape[1] == 2 and t.ndim == 5:
        return t, "kvsplit"  # [B, 2, ...]
    return t, "crosslayer"  # [B, L, ...]: every layer of a block together


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage behind ``t``."""
    import torch

    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )


def _pieces_of(name: str, view: Any, storage_ptr: int, storage_bytes: int) -> list[_Piece]:
    """Cut a blocks-first view into contiguous pieces per block."""
    elem = view.element_size()
    nb = view.shape[0]
    block_stride = view.stride(0) * elem
    base = view.data_ptr() - storage_ptr
    inner = [
        (view.shape[d], view.stride(d) * elem) for d in range(1, view.ndim) if view.shape[d] > 1
    ]
    inner.sort(key=lambda sd: sd[1])
    run = elem
    k = 0
    while k < len(inner) and inner[k][1] == run:
        run *= inner[k][0]
        k += 1
    outer = inner[k:]  # dims the contiguous run does not cover: one piece per index
    if nb > 1 and block_stride < run:
        raise ValueError(
            f"layer {name!r}: blocks overlap (block stride {block_stride} < piece {run} bytes) "
            f"in shape {tuple(view.shape)}"
        )
    pieces = []
    for idx in itertools.product(*(range(s) for s, _ in outer)):
        off = base + sum(i * st for i, (_, st) in zip(idx, outer, strict=True))
        last = off + (nb - 1) * block_stride + run
        if off < 0 or last > storage_bytes:
            raise ValueError(
                f"layer {name!r}: view of shape {tuple(view.shape)} leaves its storage"
            )
        pieces.append(_Piece(storage_ptr, off, block_stride, run))
    return pieces


def _merge(
    pieces: list[_Piece], storage_order: Mapping[tuple[str, int], int], storages: list
) -> tuple[Region, ...]:
    """Dedupe (shared tensors), order by (storage, offset), merge neighbours that touch."""
    ptr_index = {ptr: idx for (_, ptr), idx in storage_order.items()}
    uniq = sorted(set(pieces), key=lambda p: (ptr_index[p.storage_ptr], p.offset))
    out: list[Region] = []
    for p in uniq:
        sidx = ptr_index[p.storage_ptr]
        if out:
            last = out[-1]
            if last.storage == sidx and last.offset + last.block_bytes > p.offset:
                raise ValueError(
                    f"KV pieces overlap in storage {sidx}: {last} and offset {p.offset}"
                )
            if (
                last.storage == sidx
                and last.block_stride == p.block_stride
                and last.offset + last.block_bytes == p.offset
                and last.block_bytes + p.block_bytes <= p.block_stride
            ):
                out[-1] = Region(
                    sidx, last.offset, last.block_stride, last.block_bytes + p.block_bytes
                )
                continue
        out.append(Region(sidx, p.offset, p.block_stride, p.block_bytes))
    return tuple(out)


def _interleaved(pieces: list[_Piece]) -> bool:
    """True when pieces of different layers share one block stride window (block-major)."""
    by_storage: dict[int, list[_Piece]] = {}
    for p in set(pieces):
        by_storage.setdefault(p.storage_ptr, []).append(p)
    for ps in by_storage.values():
        lo = min(p.offset for p in ps)
        hi = max(p.offset + p.block_bytes for p in ps)
        if len(ps) > 1 and hi - lo <= ps[0].block_stride:
            return True
    return False


def _format_digest(groups: list[list[tuple[int, Any, int]]]) -> str:
    """Short digest of the slot byte format: each group's per-layer block shape and dtype, and
    where each logical element of a block lands in the slot (the address-order permutation).

    Two layouts with equal digests put equal KV in equal slot bytes, so the tag (part of the
    namespace) separates exactly the layouts whose pool contents are not interchangeable.
    """
    h = hashlib.sha1()
    for entries in groups:
        keys = []
        for sidx, view, base in entries:
            block = view[0]
            h.update(f"{tuple(block.shape)}:{view.dtype};".encode())
            offs = np.array([base], dtype=np.int64)
            for size, stride in zip(block.shape, block.stride(), strict=True):
                offs = (offs[:, None] + np.arange(size, dtype=np.int64) * stride).reshape(-1)
            keys.append(offs * view.element_size() + (sidx << 48))
        h.update(np.argsort(np.concatenate(keys), kind="stable").astype(np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()[:10]
