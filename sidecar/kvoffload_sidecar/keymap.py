"""The index's key -> slot map: native (`_keymap.c`) when it was built, else a dict.

Both answer the same calls: the mapping ones the index's general paths use (`get`, `[]`, `in`,
`del`, `len`, `items`, `pop`) and two batch calls on a request's packed keys, which the pool's
hot paths use so that a 1,024-key lookup, pin or store never cuts the request into 1,024 bytes
objects before answering (docs/BENCHMARKS.md, "Sidecar index"):

- `prefix(packed)`: the slots of the longest prefix of keys in the map, as int64 bytes;
- `insert_new(packed, slots)`: map each key to its slot (int64 bytes) when none is in the map
  and none repeats, True; else no change, False.

`KVOFFLOAD_NATIVE_INDEX=0` forces the dict (a comparison, or a suspect native build); the
sidecar refuses to start on any value other than 1/0, true/false, yes/no, on/off.
"""

from __future__ import annotations

import os
from array import array
from typing import Any, Protocol

from kvoffload_sidecar.keys import PoolKey, split_keys

try:
    from kvoffload_sidecar._keymap import KeyMap as NativeKeyMap
except ImportError:  # not built (no compiler where it was installed): the dict serves
    NativeKeyMap = None  # type: ignore[assignment,misc]

__all__ = ["DictKeyMap", "KeyMapLike", "NativeKeyMap", "native_enabled", "new_keymap"]


class KeyMapLike(Protocol):
    def get(self, key: PoolKey, default: Any = None, /) -> Any: ...
    def __getitem__(self, key: PoolKey) -> int: ...
    def __setitem__(self, key: PoolKey, slot: int) -> None: ...
    def __delitem__(self, key: PoolKey) -> None: ...
    def __contains__(self, key: object) -> bool: ...
    def __len__(self) -> int: ...
    def items(self) -> Any: ...
    def pop(self, key: PoolKey, default: Any, /) -> Any: ...
    def prefix(self, packed: bytes) -> bytes: ...
    def insert_new(self, packed: bytes, slots: Any) -> bool: ...


class DictKeyMap(dict):
    """The fallback: a dict with the native map's batch calls (same answers, Python speed)."""

    __slots__ = ("key_size",)

    def __init__(self, key_size: int | None) -> None:
        """`key_size` None: keys of any size, and no packed calls (an index built by hand)."""
        super().__init__()
        self.key_size = key_size

    def _split(self, packed: bytes) -> list[PoolKey]:
        if self.key_size is None:
            raise ValueError("packed keys need a map built with a key_size")
        return split_keys(packed, self.key_size, max_keys=len(packed))

    def prefix(self, packed: bytes) -> bytes:
        slots = list(map(self.get, self._split(packed)))
        if None in slots:
            del slots[slots.index(None) :]
        return array("q", slots).tobytes()

    def insert_new(self, packed: bytes, slots: Any) -> bool:
        keys = self._split(packed)
        values = array("q", bytes(slots)).tolist()
        if len(values) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(values)} slots")
        if len(set(keys)) != len(keys) or any(map(self.__contains__, keys)):
            return False
        self.update(zip(keys, values, strict=True))
        return True


NATIVE_ENV = "KVOFFLOAD_NATIVE_INDEX"
_OFF, _ON = {"0", "false", "no", "off"}, {"", "1", "true", "yes", "on"}


def native_enabled() -> bool:
    """Whether new maps are native: built, and not turned off by KVOFFLOAD_NATIVE_INDEX=0
    (or false/no/off). ValueError naming the variable for any other value."""
    raw = os.environ.get(NATIVE_ENV, "1")
    value = raw.strip().lower()
    if value in _OFF:
        return False
    if value not in _ON:
        raise ValueError(f"{NATIVE_ENV} must be 1 or 0 (or true/false, on/off), got {raw!r}")
    return NativeKeyMap is not None


def new_keymap(key_size: int | None, *, native: bool | None = None) -> KeyMapLike:
    """An empty map for keys of `key_size` bytes (native unless `native_enabled()` is false or
    `native=False`; key_size None: a dict taking keys of any size, without packed calls). The
    native map's hash is seeded per map: keys come from clients."""
    if native is None:
        native = key_size is not None and native_enabled()
    if native:
        if key_size is None:
            raise ValueError("the native key map needs a key_size")
        if NativeKeyMap is None:
            raise RuntimeError("the native key map (kvoffload_sidecar._keymap) is not built")
        return NativeKeyMap(key_size, int.from_bytes(os.urandom(8), "little"))
    return DictKeyMap(key_size)
