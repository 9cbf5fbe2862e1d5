"""Keys, ids and namespace derivation: pure functions, no state.

A `PoolKey` is an opaque fixed-size byte string chosen by the connector (block hash + KV group).
A namespace is everything that makes KV bytes interchangeable; its id is derived from the spec,
so two engines share blocks exactly when their specs are equal, never by accident.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import NewType

from kvoffload_sidecar.errors import InvalidArgument

__all__ = [
    "MAX_KEY_SIZE",
    "MAX_KEYS_PER_CALL",
    "NamespaceId",
    "NamespaceSpec",
    "PoolKey",
    "SlotId",
    "check_packed",
    "derive_namespace",
    "split_keys",
]

PoolKey = NewType("PoolKey", bytes)
NamespaceId = NewType("NamespaceId", str)
SlotId = NewType("SlotId", int)

MAX_KEY_SIZE = 256
MAX_KEYS_PER_CALL = 65536
_MAX_STR = 4096  # bytes of one spec string field; longer is a malformed request
_MAX_EXTRA = 64  # extra pairs
_NAMESPACE_VERSION = b"kvoffload.namespace.v1\x00"  # bump when the canonical encoding changes


@dataclass(frozen=True)
class NamespaceSpec:
    """Everything that makes KV bytes interchangeable (mirrors proto `NamespaceSpec`).

    `extra` is normalised at construction to a tuple of (key, value) string pairs sorted by key,
    so a proto map or a dict can be passed and equal specs compare (and hash) equal.
    """

    model: str  # the served model name: a label for stats (the weights are named in `extra`)
    dtype: str  # KV-cache dtype, e.g. "bfloat16"
    kv_layout: str  # canonical layout tag, e.g. "LBHNC/packed-kv"
    block_size: int  # tokens per GPU block
    chunk_blocks: int  # GPU blocks per offload chunk (one pool slot)
    tp_size: int  # tensor-parallel size == ranks writing one slot
    hash_algo: str  # vLLM prefix-caching hash, e.g. "sha256"
    key_size: int  # bytes per packed key
    # anything else that changes the bytes, sorted pairs: the KV groups, the pipeline stage and
    # the weights' identity (`model.*`: path, revisions, quantization, config hash, tokenizer,
    # weight files; the connector's identity.py), all in the namespace id
    extra: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        extra: object = self.extra
        if isinstance(extra, Mapping):
            extra = extra.items()
        if not isinstance(extra, Iterable):
            raise InvalidArgument(
                f"spec.extra must be pairs of strings, got {type(extra).__name__}"
            )
        try:
            pairs = tuple(sorted((k, v) for k, v in extra))
        except (TypeError, ValueError) as e:
            raise InvalidArgument(f"spec.extra must be (key, value) string pairs: {e}") from None
        object.__setattr__(self, "extra", pairs)

    def validate(self) -> None:
        """Raise `InvalidArgument` naming the first bad field."""
        for name in ("model", "dtype", "kv_layout", "hash_algo"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise InvalidArgument(f"spec.{name} must be a non-empty string, got {value!r}")
            if len(value.encode()) > _MAX_STR:
                raise InvalidArgument(f"spec.{name} is longer than {_MAX_STR} bytes")
        for name in ("block_size", "chunk_blocks", "tp_size"):
            value = getattr(self, name)
            if not is_int(value) or value < 1 or value >= 1 << 32:
                raise InvalidArgument(f"spec.{name} must be an integer >= 1, got {value!r}")
        if not is_int(self.key_size) or not 1 <= self.key_size <= MAX_KEY_SIZE:
            raise InvalidArgument(
                f"spec.key_size must be in 1..{MAX_KEY_SIZE}, got {self.key_size!r}"
            )
        if len(self.extra) > _MAX_EXTRA:
            raise InvalidArgument(f"spec.extra has {len(self.extra)} pairs, at most {_MAX_EXTRA}")
        seen: set[str] = set()
        for k, v in self.extra:
            if not isinstance(k, str) or not isinstance(v, str) or not k:
                raise InvalidArgument(f"spec.extra must map non-empty strings to strings: {k!r}")
            if len(k.encode()) > _MAX_STR or len(v.encode()) > _MAX_STR:
                raise InvalidArgument(f"spec.extra[{k!r}] is longer than {_MAX_STR} bytes")
            if k in seen:
                raise InvalidArgument(f"spec.extra has key {k!r} twice")
            seen.add(k)


def is_int(value: object) -> bool:
    """An int that is not a bool (JSON and protobuf callers hand either)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _encode_str(value: str) -> bytes:
    raw = value.encode()
    return struct.pack("<I", len(raw)) + raw


def derive_namespace(spec: NamespaceSpec) -> NamespaceId:
    """sha256 over a canonical, length-prefixed encoding of the spec; first 16 bytes as hex.

    Every field is framed (length prefix or fixed width) so no two different specs encode alike.
    The spec is validated first (`InvalidArgument`).
    """
    spec.validate()
    parts = [_NAMESPACE_VERSION]
    for f in fields(NamespaceSpec):
        value = getattr(spec, f.name)
        parts.append(_encode_str(f.name))
        if f.name == "extra":
            parts.append(struct.pack("<I", len(value)))
            for k, v in value:
                parts.append(_encode_str(k) + _encode_str(v))
        elif isinstance(value, str):
            parts.append(_encode_str(value))
        else:
            parts.append(struct.pack("<Q", value))
    return NamespaceId(hashlib.sha256(b"".join(parts)).digest()[:16].hex())


def check_packed(
    packed: bytes, key_size: int, *, max_keys: int = MAX_KEYS_PER_CALL
) -> tuple[bytes, int]:
    """(packed as bytes, key count) after the checks `split_keys` makes, without cutting."""
    if not isinstance(packed, (bytes, bytearray, memoryview)):
        raise InvalidArgument(f"keys must be bytes, got {type(packed).__name__}")
    if not 1 <= key_size <= MAX_KEY_SIZE:
        raise InvalidArgument(f"key_size must be in 1..{MAX_KEY_SIZE}, got {key_size}")
    packed = bytes(packed)
    n, rest = divmod(len(packed), key_size)
    if rest:
        raise InvalidArgument(
            f"packed keys are {len(packed)} bytes, not a multiple of key_size {key_size}"
        )
    if n > max_keys:
        raise InvalidArgument(f"{n} keys in one call, at most {max_keys}")
    return packed, n


def split_keys(packed: bytes, key_size: int, *, max_keys: int = MAX_KEYS_PER_CALL) -> list[PoolKey]:
    """Cut `key_size * n` packed bytes into n keys (`InvalidArgument` on a ragged or huge list)."""
    packed, n = check_packed(packed, key_size, max_keys=max_keys)
    if n <= 1:
        return [PoolKey(packed)] if n else []
    # One C call cuts every key: about 5x faster than slicing in a comprehension.
    return list(_unpacker(key_size, n).unpack(packed))


_CACHED_UNPACK_KEYS = 1024  # a cached Struct holds 32 B per key: <= 2 MiB for 64 of them


def _unpacker(key_size: int, n: int) -> struct.Struct:
    """A `Struct` cutting n keys of `key_size` bytes; small ones cached (batch sizes repeat)."""
    if n <= _CACHED_UNPACK_KEYS:
        return _cached_unpacker(key_size, n)
    return struct.Struct(f"{key_size}s" * n)


@lru_cache(maxsize=64)
def _cached_unpacker(key_size: int, n: int) -> struct.Struct:
    return struct.Struct(f"{key_size}s" * n)
