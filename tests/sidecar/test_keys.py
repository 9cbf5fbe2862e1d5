"""Namespace derivation and key packing: pure functions."""

from __future__ import annotations

import dataclasses

import pytest
from kvoffload_sidecar.errors import InvalidArgument
from kvoffload_sidecar.keys import NamespaceSpec, derive_namespace, split_keys


def test_namespace_id_is_stable_hex_of_16_bytes(small_spec):
    a, b = derive_namespace(small_spec()), derive_namespace(small_spec())
    assert a == b
    assert len(a) == 32 and int(a, 16) >= 0


@pytest.mark.parametrize(
    "field,value",
    [
        ("model", "other-model"),
        ("dtype", "fp8_e4m3"),
        ("kv_layout", "BLHNC/split-kv"),
        ("block_size", 32),
        ("chunk_blocks", 4),
        ("tp_size", 2),
        ("hash_algo", "sha256_cbor"),
        ("key_size", 16),
        ("extra", (("pp", "0"),)),
    ],
)
def test_every_field_changes_the_namespace(small_spec, field, value):
    base = small_spec()
    changed = dataclasses.replace(base, **{field: value})
    assert derive_namespace(changed) != derive_namespace(base)


def test_field_boundaries_cannot_collide(small_spec):
    # Without framing, "ab"+"c" and "a"+"bc" would encode alike.
    one = small_spec(model="ab", dtype="c")
    two = small_spec(model="a", dtype="bc")
    assert derive_namespace(one) != derive_namespace(two)


def test_extra_is_normalised_from_a_mapping_in_any_order(small_spec):
    a = small_spec(extra={"pp_rank": "0", "groups": "2"})
    b = small_spec(extra=(("groups", "2"), ("pp_rank", "0")))
    assert a == b and hash(a) == hash(b)
    assert a.extra == (("groups", "2"), ("pp_rank", "0"))
    assert derive_namespace(a) == derive_namespace(b)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"model": ""}, "spec.model"),
        ({"dtype": ""}, "spec.dtype"),
        ({"kv_layout": ""}, "spec.kv_layout"),
        ({"hash_algo": ""}, "spec.hash_algo"),
        ({"block_size": 0}, "spec.block_size"),
        ({"chunk_blocks": 0}, "spec.chunk_blocks"),
        ({"tp_size": 0}, "spec.tp_size"),
        ({"tp_size": True}, "spec.tp_size"),
        ({"key_size": 0}, "spec.key_size"),
        ({"key_size": 257}, "spec.key_size"),
        ({"extra": {"": "x"}}, "spec.extra"),
    ],
)
def test_bad_spec_raises_invalid_argument_naming_the_field(small_spec, overrides, message):
    spec = small_spec(**overrides)
    with pytest.raises(InvalidArgument, match=message):
        spec.validate()
    with pytest.raises(InvalidArgument, match=message):
        derive_namespace(spec)


def test_extra_that_is_not_pairs_is_rejected_at_construction(small_spec):
    with pytest.raises(InvalidArgument, match="extra"):
        small_spec(extra=5)
    with pytest.raises(InvalidArgument, match="extra"):
        small_spec(extra=[("a", "b", "c")])


def test_spec_is_frozen(small_spec):
    with pytest.raises(dataclasses.FrozenInstanceError):
        small_spec().model = "x"  # type: ignore[misc]
    assert isinstance(small_spec(), NamespaceSpec)


def test_split_keys_cuts_packed_bytes_in_order(make_keys, key_of):
    packed = make_keys([3, 1, 2], 8)
    assert split_keys(packed, 8) == [key_of(3), key_of(1), key_of(2)]
    assert split_keys(b"", 8) == []


def test_split_keys_rejects_ragged_and_oversized_lists(make_keys):
    with pytest.raises(InvalidArgument, match="not a multiple of key_size 8"):
        split_keys(make_keys([1, 2]) + b"\x00", 8)
    with pytest.raises(InvalidArgument, match="at most 2"):
        split_keys(make_keys([1, 2, 3]), 8, max_keys=2)
    with pytest.raises(InvalidArgument, match="must be bytes"):
        split_keys("abcdefgh", 8)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="key_size"):
        split_keys(b"abcd", 0)
