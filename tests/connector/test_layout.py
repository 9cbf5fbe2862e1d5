"""canonicalize: regions cover exactly the bytes of each GPU block, in the slot order."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvoffload_connector.worker.layout import SLOT_ALIGN, canonicalize

from tests.connector.kv_setup import (
    KIND_NAMES,
    block_addresses,
    expected_block,
    fill_random,
    make_kv_caches,
)


def gather_via_regions(layout, group_id: int, block: int) -> np.ndarray:
    g = layout.group(group_id)
    parts = []
    for r in g.regions:
        s = layout.storages[r.storage].numpy()
        start = r.offset + block * r.block_stride
        parts.append(s[start : start + r.block_bytes])
    return np.concatenate(parts)


def region_offsets(layout, group_id: int, block: int) -> dict[int, np.ndarray]:
    per: dict[int, list[np.ndarray]] = {}
    for r in layout.group(group_id).regions:
        start = r.offset + block * r.block_stride
        per.setdefault(r.storage, []).append(np.arange(start, start + r.block_bytes))
    return {k: np.concatenate(v) for k, v in per.items()}


def check_layout(setup, layout, blocks=None) -> None:
    ptr_index = {s.untyped_storage().data_ptr(): i for i, s in enumerate(layout.storages)}
    for g in layout.groups:
        for b in blocks if blocks is not None else range(g.num_blocks):
            # exact cover: the regions' bytes are the block's bytes, none twice, none missing
            got = region_offsets(layout, g.group_id, b)
            want = {ptr_index[k]: v for k, v in block_addresses(setup, g.group_id, b, g.num_blocks)}
            assert got.keys() == want.keys()
            for k in want:
                assert len(got[k]) == len(np.unique(got[k])), "a byte appears in two regions"
                np.testing.assert_array_equal(np.sort(got[k]), want[k])
            # gathered bytes follow the slot format
            np.testing.assert_array_equal(
                gather_via_regions(layout, g.group_id, b),
                expected_block(setup, layout, g.group_id, b),
            )


@pytest.mark.parametrize("kind", KIND_NAMES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float8_e4m3fn"])
def test_every_kind_and_dtype_is_covered_exactly(kind, dtype):
    setup = make_kv_caches(kind, dtype=dtype, heads=3, num_blocks=7)
    layout = canonicalize(setup.kv_caches, setup.layer_groups, chunk_blocks=4)
    fill_random(layout, seed=1)
    check_layout(setup, layout)
    assert layout.slot_bytes % SLOT_ALIGN == 0
    assert layout.slot_bytes >= 4 * layout.groups[0].block_bytes


@pytest.mark.parametrize(
    ("kind", "regions_per_block"),
    [("LBHNC", 3), ("BLHNC", 1), ("LHBNC", 3 * 5), ("BHLNC", 1), ("split2B", 6), ("splitB2", 3)],
)
def test_region_counts_show_merging(kind, regions_per_block):
    """Block-major pages merge into one region per block; LHBNC needs one per (layer, head)."""
    setup = make_kv_caches(kind, num_layers=3, heads=5)
    layout = canonicalize(setup.kv_caches, setup.layer_groups, chunk_blocks=2)
    assert len(layout.groups[0].regions) == regions_per_block
    assert layout.tag.startswith("BL" if kind.startswith("B") else "LB")


def test_layer_and_block_major_give_the_same_slot_bytes():
    """LBHNC and BLHNC pages in layer order: identical slot bytes for identical KV."""
    a = make_kv_caches("LBHNC", num_layers=4, num_blocks=5)
    b = make_kv_caches("BLHNC", num_layers=4, num_blocks=5)
    for name in a.kv_caches:
        a.kv_caches[name].copy_(torch.randn(a.kv_caches[name].shape).to(torch.float16))
        b.kv_caches[name].copy_(a.kv_caches[name])
    la = canonicalize(a.kv_caches, a.layer_groups, 2)
    lb = canonicalize(b.kv_caches, b.layer_groups, 2)
    for blk in range(5):
        np.testing.assert_array_equal(
            gather_via_regions(la, 0, blk), gather_via_regions(lb, 0, blk)
        )


def test_several_groups_shared_layers_and_padding():
    setup = make_kv_caches("LBHNC", groups=2, shared=True, pad=48, num_layers=2)
    layout = canonicalize(setup.kv_caches, setup.layer_groups, chunk_blocks=3)
    assert [g.group_id for g in layout.groups] == [0, 1]
    # the shared layer is deduplicated: two layers' regions, not three
    assert all(len(g.regions) == 2 for g in layout.groups)
    # padding is not part of a block's bytes
    page = 3 * 4 * 16 * 2
    assert all(
        r.block_bytes == page and r.block_stride == page + 48 for r in layout.groups[0].regions
    )
    fill_random(layout, seed=2)
    check_layout(setup, layout)
    assert layout.tag.startswith("LB/kvpacked/2g/")


def _digest(kind: str, **kw) -> str:
    s = make_kv_caches(kind, **kw)
    return canonicalize(s.kv_caches, s.layer_groups, 2).tag.rsplit("/", 1)[1]


def test_tag_digest_separates_exactly_the_incompatible_slot_formats():
    """Same slot bytes -> same digest (block count, padding, L/B order of HNC pages do not
    matter); different element placement, dtype or K/V arrangement -> different digest."""
    base = _digest("LBHNC")
    assert _digest("LBHNC", num_blocks=50, pad=32) == base
    assert _digest("BLHNC") == base
    assert _digest("LHBNC") == base
    others = {
        _digest("LBNHC"),
        _digest("BHLNC"),
        _digest("split2B"),
        _digest("LBHNC", dtype="bfloat16"),
        _digest("LBHNC", heads=5),
    }
    assert base not in others and len(others) == 5


def test_kernel_block_split_views_need_the_config():
    setup = make_kv_caches("LBHNC", kernel_split=2, block_size=8, num_blocks=6)
    layout = canonicalize(setup.kv_caches, setup.layer_groups, 2, setup.kv_cache_config)
    g = layout.groups[0]
    assert g.num_blocks == 6
    assert len(g.regions) == 3  # the two kernel blocks of a manager block merge
    fill_random(layout, seed=3)
    check_layout(setup, layout)
    # without the config the kernel blocks would be taken for manager blocks
    assert canonicalize(setup.kv_caches, setup.layer_groups, 2).groups[0].num_blocks == 12


def test_odd_heads_fp8_cover():
    setup = make_kv_caches("LBNHC", heads=5, head_size=24, dtype="float8_e4m3fn", num_blocks=9)
    layout = canonicalize(setup.kv_caches, setup.layer_groups, chunk_blocks=5)
    fill_random(layout, seed=4)
    check_layout(setup, layout)


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (torch.zeros(16, 4), "unsupported KV cache shape (16, 4)"),
        (torch.zeros(2, 2, 4, 4, 8), "ambiguous"),
        (torch.zeros(1, 4, 4, 8).expand(6, 4, 4, 8), "broadcast"),
    ],
)
def test_unknown_shapes_raise_with_the_shape(tensor, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        canonicalize({"l0": tensor}, {"l0": 0}, 1)


def test_bad_arguments_raise():
    setup = make_kv_caches("LBHNC")
    with pytest.raises(ValueError, match="chunk_blocks"):
        canonicalize(setup.kv_caches, setup.layer_groups, 0)
    with pytest.raises(ValueError, match="without a KV group"):
        canonicalize(setup.kv_caches, {}, 1)
    mixed = {"a": torch.zeros(5, 2, 4, 8), "b": torch.zeros(6, 2, 4, 8)}
    with pytest.raises(ValueError, match="blocks but group"):
        canonicalize(mixed, {"a": 0, "b": 0}, 1)
    with pytest.raises(ValueError, match="no block dim"):
        canonicalize(mixed, {"a": 0, "b": 0}, 1, type("C", (), {"num_blocks": 7})())


@pytest.mark.vllm
def test_vllm_own_views_are_covered():
    """The views vLLM 0.32's allocator makes (create_kv_cache_views) for each layout it knows."""
    import vllm.v1.kv_cache_interface as kvi
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = kvi.FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=32, dtype=torch.bfloat16)
    num_blocks, layers = 6, ["a", "b", "c"]
    page = spec.page_size_bytes
    for lay in (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC, KVCacheLayout.BLHNC):
        if lay.is_layer_compact:
            kt = kvi.KVCacheTensor(page * num_blocks * 3, layers, page * num_blocks, page)
        else:
            kt = kvi.KVCacheTensor(page * num_blocks * 3, layers, page, page * 3)
        raw = torch.zeros(kt.size, dtype=torch.int8)
        views = kvi.create_kv_cache_views(raw, spec, num_blocks, lay, kt)
        from tests.connector.kv_setup import KvSetup

        setup = KvSetup(dict(zip(layers, views, strict=True)), dict.fromkeys(layers, 0))
        setup.group_views[0] = [(v, 0) for v in views]
        layout = canonicalize(setup.kv_caches, setup.layer_groups, 4)
        fill_random(layout, seed=5)
        check_layout(setup, layout)
        assert len(layout.groups[0].regions) == (1 if lay is KVCacheLayout.BLHNC else 3)
