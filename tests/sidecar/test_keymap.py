"""The index's key -> slot map (keymap.py): the native map (_keymap.c) and the dict fallback
give the same answers as a plain dict over a long random history, and refuse bad input."""

from __future__ import annotations

import os
import random
import shutil
from array import array

import pytest
from kvoffload_sidecar import keymap
from kvoffload_sidecar.errors import InvalidArgument
from kvoffload_sidecar.keymap import DictKeyMap, new_keymap

KINDS = ["dict", "native"]


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    if request.param == "native" and keymap.NativeKeyMap is None:
        pytest.skip("the native key map is not built here (no C compiler at install)")
    return request.param


def make(kind: str, key_size: int):  # noqa: ANN201 - either map
    return new_keymap(key_size, native=kind == "native")


def i64(data: bytes) -> list[int]:
    return array("q", data).tolist()


def test_the_native_map_is_built_where_a_compiler_is() -> None:
    """CI installs with a compiler: there the native map must exist, or its tests only skip."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine")
    assert keymap.NativeKeyMap is not None, "pip install built no kvoffload_sidecar._keymap"


def test_a_long_random_history_matches_a_dict(kind: str) -> None:
    """Inserts, overwrites, deletes (tombstones, runs emptied, rehashes up and down) and batch
    calls, checked against a dict after every step that reads."""
    rng = random.Random(7)
    key_size = 33  # not a multiple of 8: the hash's tail path
    m, ref = make(kind, key_size), {}
    universe = [os.urandom(key_size) for _ in range(3000)]
    universe += [bytes(key_size), b"\x00" * (key_size - 1) + b"\x01"]  # near-identical keys
    for step in range(60_000):
        key = rng.choice(universe)
        op = rng.random()
        if op < 0.45:
            value = rng.randrange(1 << 40)
            m[key] = value
            ref[key] = value
        elif op < 0.75:
            if key in ref:
                del m[key]
                del ref[key]
            else:
                with pytest.raises(KeyError):
                    del m[key]
        elif op < 0.85:
            assert m.pop(key, -7) == ref.pop(key, -7)
        else:
            assert m.get(key) == ref.get(key) and (key in m) == (key in ref)
            assert m.get(key, "absent") == ref.get(key, "absent")
        if step % 3000 == 0:
            assert len(m) == len(ref) and dict(m.items()) == ref
            asked = rng.sample(universe, 40)
            packed = b"".join(asked)
            assert [m.get(k, -1) for k in asked] == [ref.get(k, -1) for k in asked]
            prefix = []
            for k in asked:
                if k not in ref:
                    break
                prefix.append(ref[k])
            assert i64(m.prefix(packed)) == prefix
    assert len(m) == len(ref) and dict(m.items()) == ref


def test_insert_new_is_all_or_nothing(kind: str) -> None:
    m = make(kind, 8)
    keys = [i.to_bytes(8, "little") for i in range(300)]
    assert m.insert_new(b"".join(keys), array("q", range(300)).tobytes()) is True
    assert [m[k] for k in keys] == list(range(300))
    before = dict(m.items())
    fresh = [i.to_bytes(8, "little") for i in range(1000, 1100)]
    known = [*fresh[:50], keys[3], *fresh[50:]]  # one key already mapped, mid-batch
    assert m.insert_new(b"".join(known), array("q", range(101)).tobytes()) is False
    repeated = [*fresh, fresh[10]]  # one key twice
    assert m.insert_new(b"".join(repeated), array("q", range(101)).tobytes()) is False
    assert dict(m.items()) == before and len(m) == 300
    assert i64(m.prefix(b"".join(keys[:5] + fresh[:1] + keys[5:6]))) == [0, 1, 2, 3, 4]


def test_bad_input_is_refused_with_a_clear_error(kind: str) -> None:
    m = make(kind, 8)
    with pytest.raises((ValueError, InvalidArgument), match="multiple of"):
        m.prefix(b"\x00" * 12)
    with pytest.raises((ValueError, InvalidArgument), match="multiple of"):
        m.insert_new(b"\x00" * 7, b"")
    with pytest.raises(ValueError, match="slots"):
        m.insert_new(b"\x00" * 16, array("q", [1]).tobytes())
    assert m.get(b"short") is None and b"short" not in m  # another size is never a member
    if kind == "native":
        with pytest.raises(TypeError, match="bytes"):
            m.get("a string key")
        with pytest.raises(ValueError, match="8-byte keys"):
            m[b"short"] = 1
        with pytest.raises(ValueError, match="key_size"):
            keymap.NativeKeyMap(0)
        bare = keymap.NativeKeyMap.__new__(keymap.NativeKeyMap)
        with pytest.raises(RuntimeError, match="__init__"):
            bare.get(b"\x00" * 8)
    assert len(m) == 0


def test_the_native_map_is_seeded_per_map_and_holds_a_million_keys() -> None:
    if keymap.NativeKeyMap is None:
        pytest.skip("the native key map is not built here")
    a = keymap.NativeKeyMap(32, 1)
    b = keymap.NativeKeyMap(32, 2)
    n = 1 << 20
    packed = b"".join(i.to_bytes(32, "big") for i in range(n))  # sequential: a weak hash clusters
    slots = array("q", range(n)).tobytes()
    assert a.insert_new(packed, slots) and b.insert_new(packed, slots)
    assert len(a) == len(b) == n
    assert i64(a.prefix(packed)) == list(range(n)) == i64(b.prefix(packed))


def test_the_dict_fallback_takes_keys_of_any_size_without_packed_calls() -> None:
    m = DictKeyMap(None)
    m[b"a"] = 1
    m[b"longer key"] = 2
    assert m.get(b"a") == 1 and len(m) == 2
    with pytest.raises(ValueError, match="key_size"):
        m.prefix(b"aa")


def test_kvoffload_native_index_0_turns_the_native_map_off(monkeypatch) -> None:
    for off in ("0", "false", "OFF", " no "):
        monkeypatch.setenv("KVOFFLOAD_NATIVE_INDEX", off)
        assert not keymap.native_enabled(), off
    monkeypatch.setenv("KVOFFLOAD_NATIVE_INDEX", "2")
    with pytest.raises(ValueError, match="KVOFFLOAD_NATIVE_INDEX must be 1 or 0"):
        keymap.native_enabled()
    monkeypatch.setenv("KVOFFLOAD_NATIVE_INDEX", "0")
    assert isinstance(new_keymap(32), DictKeyMap)
    with pytest.raises(ValueError, match="key_size"):
        new_keymap(None, native=True)  # the native map has fixed-size keys
    monkeypatch.delenv("KVOFFLOAD_NATIVE_INDEX")
    expected = DictKeyMap if keymap.NativeKeyMap is None else keymap.NativeKeyMap
    assert isinstance(new_keymap(32), expected)
