"""Builders of vLLM-shaped KV caches and a slow, obvious oracle (the transfer tests and
`bench/transfer.py` use them; not shipped).

``make_kv_caches`` allocates KV caches the way vLLM versions hand them to ``register_kv_caches``
(0.32/0.33: strided ``[B, H, N, C]`` views into one int8 allocation in any ``KVCacheLayout``;
older: per-layer ``[2, B, ...]`` or ``[B, 2, ...]`` tensors; block-outermost cross-layer tensors),
with several groups, shared layers, padded pages, odd head counts and fp16/bf16/fp8.
``expected_block`` and ``apply_store``/``apply_load`` re-derive the data movement from the
tensors with Python loops over blocks, independent of the engines' index arithmetic.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch
    from kvoffload_connector.worker.layout import CanonicalLayout

__all__ = ["KIND_NAMES", "KvSetup", "expected_block", "make_kv_caches", "random_batches"]

# physical order of logical (L, B, H, N, C) for the strided kinds (vLLM's KVCacheLayout values)
_ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
KIND_NAMES = (*_ORDERS, "split2B", "splitB2", "crosslayer")


@dataclass
class KvSetup:
    """What ``register_kv_caches`` would receive, plus what canonicalize needs beside it."""

    kv_caches: dict[str, torch.Tensor]
    layer_groups: dict[str, int]
    kv_cache_config: object | None = None
    # per group: the distinct tensors of its layers in order, with the index of the block dim
    group_views: dict[int, list[tuple[torch.Tensor, int]]] = field(default_factory=dict)


@dataclass
class _FakeKVCacheConfig:
    num_blocks: int


def make_kv_caches(
    kind: str,
    *,
    num_layers: int = 3,
    num_blocks: int = 12,
    heads: int = 3,
    block_size: int = 4,
    head_size: int = 8,
    dtype: str = "float16",
    groups: int = 1,
    shared: bool = False,
    pad: int = 0,
    device: str = "cpu",
    kernel_split: int = 1,
) -> KvSetup:
    """KV caches of ``kind`` (``KIND_NAMES``) with ``groups`` groups of ``num_layers`` layers.

    ``shared``: one more layer per group reusing the last layer's tensor. ``pad``: extra bytes
    per page (strided kinds with L or B outermost). ``kernel_split``: strided kinds only, views of
    ``[B * k, H, N / k, C]`` as vLLM makes with kernel-block splitting (passes a config).
    """
    import torch

    tdtype = getattr(torch, dtype)
    elem = torch.empty(0, dtype=tdtype).element_size()
    setup = KvSetup({}, {})
    if kind in _ORDERS:
        # 0.33 style: one int8 allocation, groups overlay per layer slot as vLLM's HMA does
        c_bytes = 2 * head_size * elem
        page = heads * block_size * c_bytes + pad
        order = _ORDERS[kind]
        if pad and set(order[:2]) != {0, 1}:
            raise ValueError("pad needs L and B outermost")
        nbytes = num_layers * num_blocks * page
        raw = torch.zeros(nbytes + 64, dtype=torch.int8, device=device)
        logical = (num_layers, num_blocks, heads, block_size, c_bytes)
        strides = [0] * 5
        cur = 1
        for pos, dim in reversed(list(enumerate(order))):
            if pos == 1 and set(order[:2]) == {0, 1}:
                cur = page  # the page grid: L and B outermost, pages possibly padded
            strides[dim] = cur
            cur *= logical[dim]
        view5 = torch.as_strided(raw, logical, strides, raw.storage_offset() + 64)
        for g in range(groups):
            for layer in range(num_layers):
                v = view5[layer].view(tdtype)  # [B, H, N, 2D]
                if kernel_split > 1:
                    v = _kernel_split(v, kernel_split)
                _add(setup, f"g{g}.l{layer}", g, v, 0)
        if kernel_split > 1:
            setup.kv_cache_config = _FakeKVCacheConfig(num_blocks)
    elif kind == "split2B":
        for g in range(groups):
            for layer in range(num_layers):
                t = torch.zeros(
                    2, num_blocks, block_size, heads, head_size, dtype=tdtype, device=device
                )
                _add(setup, f"g{g}.l{layer}", g, t, 1)
    elif kind == "splitB2":
        for g in range(groups):
            for layer in range(num_layers):
                t = torch.zeros(
                    num_blocks, 2, heads, block_size, head_size, dtype=tdtype, device=device
                )
                _add(setup, f"g{g}.l{layer}", g, t, 0)
    elif kind == "crosslayer":
        for g in range(groups):
            t = torch.zeros(
                num_blocks,
                num_layers,
                block_size,
                heads,
                2 * head_size,
                dtype=tdtype,
                device=device,
            )
            _add(setup, f"g{g}.all", g, t, 0)
    else:
        raise ValueError(f"unknown kind {kind!r}; one of {KIND_NAMES}")
    if shared:
        for g in range(groups):
            last = next(n for n in reversed(setup.kv_caches) if setup.layer_groups[n] == g)
            setup.kv_caches[f"g{g}.shared"] = setup.kv_caches[last]
            setup.layer_groups[f"g{g}.shared"] = g
    return setup


def _kernel_split(v: torch.Tensor, k: int) -> torch.Tensor:
    """[B, H, N, C] -> [B * k, H, N / k, C] the way vLLM views kernel blocks."""
    import torch

    b, h, n, c = v.shape
    if n % k:
        raise ValueError(f"block size {n} does not split into {k}")
    s = v.stride()
    if s[0] != h * n * c or s[1] != n * c:
        raise ValueError("kernel_split needs dense HNC pages")
    return torch.as_strided(v, (b * k, h, n // k, c), (s[0] // k, (n // k) * c, c, 1))


def _add(setup: KvSetup, name: str, group: int, t: torch.Tensor, block_dim: int) -> None:
    setup.kv_caches[name] = t
    setup.layer_groups[name] = group
    setup.group_views.setdefault(group, []).append((t, block_dim))


def fill_random(layout: CanonicalLayout, seed: int) -> None:
    """Random bytes in every storage (never zeros: unwritten bytes must show)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for s in layout.storages:
        s.copy_(torch.randint(0, 256, s.shape, dtype=torch.uint8, generator=gen).to(s.device))


def block_addresses(setup: KvSetup, group: int, block: int, num_blocks: int) -> list:
    """Every byte of ``block`` of ``group`` as ``(storage_key, sorted byte offsets)`` per storage,
    storages in first-seen order, derived from the tensors' shapes and strides alone."""
    per_storage: dict[int, list[np.ndarray]] = {}
    for t, dim in setup.group_views[group]:
        ratio = t.shape[dim] // num_blocks
        storage = t.untyped_storage()
        e = t.element_size()
        for j in range(ratio):
            sub = t.select(dim, block * ratio + j)
            offs = np.array([sub.data_ptr() - storage.data_ptr()], dtype=np.int64)
            for size, stride in zip(sub.shape, sub.stride(), strict=True):
                offs = (offs[:, None] + np.arange(size, dtype=np.int64) * stride * e).reshape(-1)
            offs = (offs[:, None] + np.arange(e, dtype=np.int64)).reshape(-1)
            per_storage.setdefault(storage.data_ptr(), []).append(offs)
    return [(key, np.unique(np.concatenate(v))) for key, v in per_storage.items()]


def expected_block(setup: KvSetup, layout: CanonicalLayout, group: int, block: int) -> np.ndarray:
    """The slot bytes of ``block`` of ``group``: all its bytes in (storage, address) order."""
    num_blocks = layout.group(group).num_blocks
    by_ptr = {s.untyped_storage().data_ptr(): s for s in layout.storages}
    order = {s.untyped_storage().data_ptr(): i for i, s in enumerate(layout.storages)}
    parts = []
    for key, offs in sorted(
        block_addresses(setup, group, block, num_blocks), key=lambda kv: order[kv[0]]
    ):
        parts.append(by_ptr[key].cpu().numpy()[offs])
    return np.concatenate(parts)


def random_batches(
    layout: CanonicalLayout,
    slot_count: int,
    rng: random.Random,
    max_blocks: int = 8,
    exclude: set[int] | None = None,
) -> list:
    """One batch per group: random GPU blocks laid into random distinct slots, each chunk
    starting at a random (often unaligned) position, as the connector plans chunks.

    Block ids are distinct across groups (and avoid ``exclude``): in vLLM a block id belongs to
    one group at a time, and groups may overlay the same bytes.
    """
    from kvoffload_connector.worker.transfer.contract import TransferBatch

    batches = []
    free_slots = list(range(slot_count))
    rng.shuffle(free_slots)
    taken = set(exclude or ())
    cb = layout.chunk_blocks
    for g in layout.groups:
        candidates = [b for b in range(g.num_blocks) if b not in taken]
        n = rng.randint(1, min(max_blocks, len(candidates)))
        blocks = rng.sample(candidates, n)
        taken.update(blocks)
        slots, pos = [], []
        k = 0
        while k < n:
            start = rng.randrange(cb)
            take = min(cb - start, n - k)
            slot = free_slots.pop()
            slots += [slot] * take
            pos += list(range(start, start + take))
            k += take
        batches.append(TransferBatch(g.group_id, np.array(blocks), np.array(slots), np.array(pos)))
    return batches


def write_block(setup: KvSetup, layout: CanonicalLayout, group: int, block: int, data) -> None:
    """Put slot-format bytes ``data`` into ``block`` of ``group`` (inverse of expected_block)."""
    import torch

    num_blocks = layout.group(group).num_blocks
    by_ptr = {s.untyped_storage().data_ptr(): s for s in layout.storages}
    order = {s.untyped_storage().data_ptr(): i for i, s in enumerate(layout.storages)}
    at = 0
    addrs = sorted(block_addresses(setup, group, block, num_blocks), key=lambda kv: order[kv[0]])
    for key, offs in addrs:
        storage = by_ptr[key]
        idx = torch.from_numpy(offs).to(storage.device)
        chunk = torch.from_numpy(np.ascontiguousarray(data[at : at + len(offs)]))
        storage[idx] = chunk.to(storage.device)
        at += len(offs)
    if at != len(data):
        raise ValueError(f"block has {at} bytes, data has {len(data)}")


POISON = 0x5A


def _storage_snapshot(layout: CanonicalLayout) -> list[np.ndarray]:
    return [s.cpu().numpy().copy() for s in layout.storages]


def _block_mask(setup: KvSetup, layout: CanonicalLayout, blocks: dict[int, list[int]]) -> list:
    """Per storage, a bool mask of the bytes of the given blocks of each group."""
    order = {s.untyped_storage().data_ptr(): i for i, s in enumerate(layout.storages)}
    masks = [np.zeros(s.numel(), dtype=bool) for s in layout.storages]
    for gid, ids in blocks.items():
        nb = layout.group(gid).num_blocks
        for blk in ids:
            for key, offs in block_addresses(setup, gid, blk, nb):
                masks[order[key]][offs] = True
    return masks


def round_trip(
    setup: KvSetup,
    layout: CanonicalLayout,
    pool,
    engine,
    rng: random.Random,
    max_blocks: int = 8,
    layered: bool = False,
) -> int:
    """STORE random blocks into random (unaligned) chunk positions of a poisoned pool, check
    every pool byte; LOAD them back into other, poisoned blocks, check those and that no other
    KV byte changed. Returns the bytes moved. Raises AssertionError on any difference.
    ``layered``: the LOAD goes through ``submit_layered`` and the bytes are checked once the
    current stream has waited for every layer (``wait_layer``), before the job is reaped."""
    from kvoffload_connector.worker.transfer.contract import Direction, TransferBatch

    fill_random(layout, seed=rng.randrange(1 << 30))
    pool.tensor.fill_(POISON)
    fewest = min(g.num_blocks for g in layout.groups)
    cap = max(1, min(max_blocks, fewest // (2 * len(layout.groups))))
    batches = random_batches(layout, pool.slot_count, rng, max_blocks=cap)
    job = rng.randrange(1 << 40)
    engine.submit(job, Direction.STORE, batches)
    [res] = engine.wait([job])
    assert res.ok and res.job_id == job, res
    want_pool = np.full(tuple(pool.tensor.shape), POISON, dtype=np.uint8)
    sources = {}
    for b in batches:
        gbb = layout.group(b.group).block_bytes
        for blk, slot, pos in zip(b.gpu_blocks, b.slots, b.slot_block_index, strict=True):
            data = expected_block(setup, layout, b.group, int(blk))
            sources[(b.group, int(blk))] = data
            want_pool[slot, pos * gbb : (pos + 1) * gbb] = data
    got_pool = pool.tensor.numpy()
    assert np.array_equal(got_pool, want_pool), (
        f"pool differs at {np.argwhere(got_pool != want_pool)[:5]}"
    )
    assert res.bytes == sum(len(v) for v in sources.values())

    used = {blk for (_, blk) in sources}
    loads, dst_of = [], {}
    for b in batches:
        g = layout.group(b.group)
        free = [x for x in range(g.num_blocks) if x not in used]
        dst = rng.sample(free, len(b))
        used.update(dst)
        for src, d in zip(b.gpu_blocks, dst, strict=True):
            dst_of[(b.group, d)] = sources[(b.group, int(src))]
            write_block(setup, layout, b.group, d, np.full(g.block_bytes, POISON, np.uint8))
        loads.append(TransferBatch(b.group, np.array(dst), b.slots, b.slot_block_index))
    before = _storage_snapshot(layout)
    job2 = job + 1
    if layered:
        import torch

        engine.new_step()
        engine.submit_layered(job2, loads)
        for name, _, _ in layout.layers:
            engine.wait_layer(name)
        if layout.storages[0].is_cuda:
            torch.cuda.current_stream().synchronize()  # the stream waits, not the job
        for (gid, d), data in dst_of.items():
            assert np.array_equal(expected_block(setup, layout, gid, d), data), f"{gid}/{d}"
    else:
        engine.submit(job2, Direction.LOAD, loads)
    [res2] = engine.wait([job2])
    assert res2.ok, res2
    for (gid, d), data in dst_of.items():
        assert np.array_equal(expected_block(setup, layout, gid, d), data), f"block {gid}/{d}"
    dst_blocks: dict[int, list[int]] = {}
    for gid, d in dst_of:
        dst_blocks.setdefault(gid, []).append(d)
    masks = _block_mask(setup, layout, dst_blocks)
    after = _storage_snapshot(layout)
    for i, (m, b0, b1) in enumerate(zip(masks, before, after, strict=True)):
        assert np.array_equal(b0[~m], b1[~m]), f"bytes outside the loaded blocks changed in {i}"
    return res.bytes + res2.bytes
