"""Pool keys and the namespace spec (no torch).

A chunk of one KV group is keyed by vLLM's block hash of the chunk's *last*
block (hashes are chained, so it names the whole prefix) followed by the group
index as 4 big-endian bytes, the same packing vLLM's native offloader uses.
Keys are fixed-size so a batch travels as one packed `bytes` field.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NewType

PoolKey = NewType("PoolKey", bytes)

GROUP_BYTES = 4
# Digest size of vLLM's prefix-caching hash functions (utils/hashing.py).
HASH_BYTES = {"sha256": 32, "sha256_cbor": 32, "xxhash": 16, "xxhash_cbor": 16}


def key_size_for(hash_algo: str) -> int:
    try:
        return HASH_BYTES[hash_algo] + GROUP_BYTES
    except KeyError:
        raise ValueError(
            f"unsupported prefix_caching_hash_algo {hash_algo!r} (known: {sorted(HASH_BYTES)})"
        ) from None


def make_key(block_hash: bytes, group: int) -> PoolKey:
    return PoolKey(bytes(block_hash) + group.to_bytes(GROUP_BYTES, "big"))


def chunk_keys(
    block_hashes: Sequence[bytes],
    chunk_blocks: int,
    group: int,
    limit: int | None = None,
    start: int = 0,
) -> list[PoolKey]:
    """Keys of the full chunks of one group, in prefix order: chunks [start, limit)."""
    suffix = group.to_bytes(GROUP_BYTES, "big")
    n = len(block_hashes) // chunk_blocks
    if limit is not None:
        n = min(n, limit)
    return [
        PoolKey(bytes(block_hashes[(c + 1) * chunk_blocks - 1]) + suffix) for c in range(start, n)
    ]


def in_epoch(keys: list[PoolKey], epoch: bytes | None) -> list[PoolKey]:
    """`keys` as one cache epoch names them (keyed BLAKE2b, same size). After vLLM resets the
    connector's cache (new weights) the scheduler starts an epoch with a fresh random value, so
    nothing stored before is found again, by this engine or by one started later. None: the
    first epoch, the keys as they are (nothing to pay until a reset)."""
    if epoch is None:
        return keys
    return [PoolKey(hashlib.blake2b(k, digest_size=len(k), key=epoch).digest()) for k in keys]


def pack(keys: Sequence[bytes], key_size: int) -> bytes:
    """Concatenate keys for a batched RPC; every key must be `key_size` bytes."""
    packed = b"".join(keys)
    if len(packed) != key_size * len(keys):
        raise ValueError(f"keys must all be {key_size} bytes")
    return packed


def unpack_slots(packed: bytes) -> list[int]:
    """Slot numbers from a reply (4-byte little-endian uint32s, kvoffload.v1); ValueError when
    the length is not a multiple of 4."""
    if len(packed) % 4:
        raise ValueError(f"packed slots are {len(packed)} bytes, not a multiple of 4")
    slots = array("I", packed)
    if _BIG_ENDIAN:
        slots.byteswap()
    return slots.tolist()


_BIG_ENDIAN = sys.byteorder == "big"
assert array("I").itemsize == 4, "the wire's slot numbers are 4-byte uint32s"


@dataclass(frozen=True)
class SpecFields:
    """Everything that makes KV bytes interchangeable (mirrors proto NamespaceSpec)."""

    model: str
    dtype: str
    kv_layout: str
    block_size: int
    chunk_blocks: int
    tp_size: int
    hash_algo: str
    key_size: int
    extra: Mapping[str, str] = field(default_factory=dict)

    def to_proto(self):  # -> pool_pb2.NamespaceSpec
        from kvoffload.v1 import pool_pb2

        return pool_pb2.NamespaceSpec(
            model=self.model,
            dtype=self.dtype,
            kv_layout=self.kv_layout,
            block_size=self.block_size,
            chunk_blocks=self.chunk_blocks,
            tp_size=self.tp_size,
            hash_algo=self.hash_algo,
            key_size=self.key_size,
            extra=dict(self.extra),
        )

    @classmethod
    def from_proto(cls, spec) -> SpecFields:
        return cls(
            model=spec.model,
            dtype=spec.dtype,
            kv_layout=spec.kv_layout,
            block_size=spec.block_size,
            chunk_blocks=spec.chunk_blocks,
            tp_size=spec.tp_size,
            hash_algo=spec.hash_algo,
            key_size=spec.key_size,
            extra=dict(spec.extra),
        )


def build_spec(
    *,
    model: str,
    dtype: str,
    kv_layout: str,
    block_size: int,
    chunk_blocks: int,
    tp_size: int,
    hash_algo: str,
    group_specs: Sequence[str],
    pp_rank: int = 0,
    pp_size: int = 1,
    identity: Mapping[str, str] | None = None,
) -> SpecFields:
    """The namespace spec of one engine: anything that changes the bytes goes in.

    `group_specs` describes each KV group (kind, window, heads, head size) so two
    models that only differ in their attention layout never share a namespace.
    `identity` names the weights (`identity.model_identity`: path, revisions, quantization,
    config hash, tokenizer, weight files); `model` is then only the label stats show.
    """
    extra = {**(identity or {}), "kv_groups": ";".join(group_specs)}
    if pp_size > 1:
        extra["pp"] = f"{pp_rank}/{pp_size}"
    return SpecFields(
        model=model,
        dtype=dtype,
        kv_layout=kv_layout,
        block_size=block_size,
        chunk_blocks=chunk_blocks,
        tp_size=tp_size,
        hash_algo=hash_algo,
        key_size=key_size_for(hash_algo),
        extra=extra,
    )
