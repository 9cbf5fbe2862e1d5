"""The presence map (sidecar/presence.py) kept by a real Pool, read by the connector's reader.

The one property that matters: every key in the index (reserved or committed) reads as
"maybe present", so a "surely absent" answer never hides a hit; stale marks from evicted keys
go at the next rebuild, and an adopted pool file's keys are marked when the map is attached.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from kvoffload_connector.common.presence import PresenceView, open_presence
from kvoffload_sidecar.pool import Pool, Registration
from kvoffload_sidecar.presence import PresenceMap

MiB = 1 << 20


def key(i: int) -> bytes:
    """An 8-byte key with a hash-like head, as vLLM's block hashes give."""
    return hashlib.sha256(i.to_bytes(8, "big")).digest()[:8]


def store(pool: Pool, reg: Registration, *ints: int) -> None:
    res = pool.reserve_store(reg.namespace_id, reg.client_id, b"".join(key(i) for i in ints))
    if res.store_id:
        pool.commit_store(reg.namespace_id, res.store_id, 0)


def test_every_live_key_reads_present_and_stale_ones_go_at_the_rebuild(
    make_pool, small_spec, pool_dir: Path
) -> None:
    pool = make_pool()
    assert pool.wait_ready(10)
    reg = pool.register(small_spec(), 1, 1 * MiB, "engine-0/scheduler")
    pm = PresenceMap(pool_dir / "pool.sock.presence", bits=8)  # 256 buckets, rebuilt at 32 marks
    pool.attach_presence(pm)
    view = open_presence(str(pool_dir / "pool.sock"), "pool.sock.presence")
    assert view is not None
    assert not any(view.maybe_present(key(i)) for i in range(4))  # an empty pool: all absent
    res = pool.reserve_store(reg.namespace_id, reg.client_id, key(1))
    assert view.maybe_present(key(1))  # marked when reserved, before any commit
    pool.commit_store(reg.namespace_id, res.store_id, 0)
    rebuilds = []
    for i in range(2, 200):  # 8 slots: nearly every store evicts; the map rebuilds on the way
        before = pm.marks_since_rebuild
        store(pool, reg, i)
        if pm.marks_since_rebuild < before:
            rebuilds.append(i)
        live = [k for k in range(1, i + 1) if pool.lookup(reg.namespace_id, [key(k)])[0]]
        assert len(live) <= 8
        assert all(view.maybe_present(key(k)) for k in live), i  # never a false "absent"
    assert rebuilds, "the stale marks of evicted keys were never rebuilt away"
    # right after the last rebuild only the then-live keys were marked: far fewer than 256
    assert pm.set_buckets() < 64
    evicted = [k for k in range(1, 200) if not pool.lookup(reg.namespace_id, [key(k)])[0]]
    assert sum(not view.maybe_present(key(k)) for k in evicted) > len(evicted) // 2


def test_an_adopted_pool_file_is_marked_when_the_map_is_attached(
    make_pool, small_spec, pool_dir: Path
) -> None:
    first = make_pool()
    assert first.wait_ready(10)
    reg = first.register(small_spec(), 1, 1 * MiB, "engine-0/scheduler")
    store(first, reg, 7, 8)
    first.close()  # the file stays: the next pool adopts it
    second = make_pool()
    assert second.wait_ready(10)
    second.attach_presence(PresenceMap(pool_dir / "p.presence", bits=12))
    view = PresenceView(str(pool_dir / "p.presence"))
    assert view.maybe_present(key(7)) and view.maybe_present(key(8))
    assert not view.maybe_present(key(9))


def test_the_reader_refuses_what_it_cannot_read(pool_dir: Path) -> None:
    junk = pool_dir / "junk.presence"
    junk.write_bytes(b"not a map" * 20)
    with pytest.raises(ValueError, match="not a presence map"):
        PresenceView(str(junk))
    assert open_presence(str(pool_dir / "pool.sock"), "junk.presence") is None  # logged, no map
    assert open_presence(str(pool_dir / "pool.sock"), "../etc/passwd") is None
    assert open_presence(str(pool_dir / "pool.sock"), "") is None  # not offered
    pm = PresenceMap(pool_dir / "short.presence", bits=10)
    pm.close(unlink=False)
    Path(pool_dir / "short.presence").write_bytes(
        Path(pool_dir / "short.presence").read_bytes()[:600]
    )
    with pytest.raises(ValueError, match="too short"):
        PresenceView(str(pool_dir / "short.presence"))
    with pytest.raises(ValueError, match="bucket bits"):
        PresenceMap(pool_dir / "x.presence", bits=40)


def test_keys_shorter_than_a_head_are_marked_as_the_reader_reads_them(pool_dir: Path) -> None:
    """Any key size the spec allows (1..): a short key's bucket is its zero-padded head on both
    sides, so a store of 3-byte keys neither fails nor reads absent."""
    pm = PresenceMap(pool_dir / "short.presence", bits=16)
    view = PresenceView(str(pool_dir / "short.presence"))
    short = [bytes([7, i, 200]) for i in range(5)]
    pm.mark_packed(b"".join(short), 3)
    assert all(view.maybe_present(k) for k in short)
    assert not view.maybe_present(bytes([8, 0, 200]))
