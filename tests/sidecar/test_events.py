"""Block events for vLLM's KV events: the pool's log (events.py) and the connector's feed.

The pool logs a key when every rank committed it and when eviction took it, with the blob its
reservation sent; a feed new to the log reads a snapshot. These tests drive a real Pool (and a
real sidecar process over its socket) and read the log the way the connector's `EventFeed`
does, into vLLM's own BlockStored/BlockRemoved types.
"""

from __future__ import annotations

import os

import pytest
from kvoffload_sidecar import events as sidecar_events
from kvoffload_sidecar.errors import InvalidArgument
from kvoffload_sidecar.keys import MAX_KEYS_PER_CALL

pytest.importorskip("msgspec")

from kvoffload_connector.scheduler.events import EventFeed, announce_blob, decode_blob  # noqa: E402

from tests.sidecar.event_helpers import (  # noqa: E402
    BLOCK,
    CHUNK_BLOCKS,
    MiB,
    chunk_blob,
    chunk_key,
    ext_hashes,
    make_request,
)


def _store(pool, reg, request, chunks, *, commit=True) -> int:
    keys = [chunk_key(request, c) for c in chunks]
    res = pool.reserve_store(
        reg.namespace_id, reg.client_id, b"".join(keys), [chunk_blob(request, c) for c in chunks]
    )
    if commit and res.store_id:
        assert pool.commit_store(reg.namespace_id, res.store_id, 0)
    return res.store_id


def _feed(pool, reg, **kw) -> EventFeed:
    def fetch(log_id, after_seq, cursor, max_events):
        return pool.events(reg.namespace_id, log_id, after_seq, cursor, max_events)

    return EventFeed(fetch, **kw)


@pytest.fixture
def pool_reg(make_pool, small_spec):
    # 1 MiB slots: 8 slots in the test pool (eviction after 8 chunks)
    pool = make_pool(eviction="lru", detach_grace_s=0)
    spec = small_spec(key_size=36)
    reg = pool.register(spec, 1, 1 * MiB, "engine/scheduler")
    return pool, reg


def test_blob_round_trip_carries_vllms_hashes_tokens_parent_and_salt():
    req = make_request(6, seed=3, salt="tenant-a")
    first, second = decode_blob(chunk_blob(req, 0)), decode_blob(chunk_blob(req, 1))
    assert first.hashes == tuple(req.block_hashes[0:2]) and first.parent is None
    assert second.hashes == tuple(req.block_hashes[2:4])
    assert second.parent == req.block_hashes[1]  # the block before the chunk
    assert second.tokens == req.all_token_ids[8:16] and second.block_size == BLOCK
    # the cache salt is in the first block's extra keys only, as vLLM's GPU-tier event has it
    assert first.extra_keys[0] == ("tenant-a",) and first.extra_keys[1] is None
    assert second.extra_keys is None
    assert decode_blob(b"") is None and decode_blob(b"\x01garbage") is None


def test_blobs_carry_their_key_epoch_and_nine_field_blobs_read_as_the_first_epoch():
    import msgspec

    req = make_request(2, seed=4)
    blob = announce_blob(req, 0, 0, CHUNK_BLOCKS, BLOCK, b"epoch-1!")
    assert decode_blob(blob).epoch == b"epoch-1!"
    nine = msgspec.msgpack.encode(msgspec.msgpack.decode(blob)[:9])  # an older connector's
    assert decode_blob(nine).epoch == b"" and decode_blob(nine).hashes == decode_blob(blob).hashes


def test_a_cache_reset_announces_every_block_removed_and_the_old_epoch_never_again(pool_reg):
    # reset_connector (a weight update) moved the engine's keys to a new epoch: what the pool
    # holds from before cannot load here any more, so a router must stop counting on it. Its
    # later eviction says nothing, and a snapshot (a restarted sidecar) does not bring it back.
    pool, reg = pool_reg
    feed = _feed(pool, reg)
    feed.poll()
    old = make_request(2 * CHUNK_BLOCKS, seed=1)
    _store(pool, reg, old, [0, 1])
    feed.poll()
    assert [type(e).__name__ for e in feed.take()] == ["BlockStored"] * 2
    assert feed.retire(b"epoch-1!") == 2
    removed = feed.take()
    assert [type(e).__name__ for e in removed] == ["BlockRemoved"] * 2
    assert [e.block_hashes for e in removed] == [
        ext_hashes(old.block_hashes[i : i + 2]) for i in (0, 2)
    ]
    # new-epoch stores are announced; enough of them evict the old chunks, silently
    slots = pool.stats().namespaces[0].slot_count
    new = [make_request(2 * CHUNK_BLOCKS, seed=s) for s in range(2, 2 + slots // 2)]
    for r in new:
        keys = [bytes([9]) + chunk_key(r, c)[1:] for c in (0, 1)]  # keys of another epoch
        blobs = [
            announce_blob(r, 0, c * CHUNK_BLOCKS, CHUNK_BLOCKS, BLOCK, b"epoch-1!") for c in (0, 1)
        ]
        res = pool.reserve_store(reg.namespace_id, reg.client_id, b"".join(keys), blobs)
        assert pool.commit_store(reg.namespace_id, res.store_id, 0)
        feed.poll()
    events = feed.take()
    assert pool.stats().namespaces[0].evicted_blocks >= 2  # the old chunks left the pool
    assert [type(e).__name__ for e in events] == ["BlockStored"] * slots, events
    # a fresh feed in the new epoch (the sidecar's snapshot): the new blocks only
    fresh = _feed(pool, reg)
    fresh.retire(b"epoch-1!")
    first_epoch = make_request(2 * CHUNK_BLOCKS, seed=50)
    _store(pool, reg, first_epoch, [0])  # a first-epoch blob (it evicts one new chunk)
    fresh.poll()
    announced = {tuple(e.block_hashes) for e in fresh.take()}
    assert len(announced) == slots - 1  # everything the pool holds but the first-epoch chunk
    assert announced < {tuple(e.block_hashes) for e in events}


def test_commits_are_announced_aborts_and_reservations_are_not(pool_reg):
    pool, reg = pool_reg
    feed = _feed(pool, reg)
    assert feed.poll() == 0  # the first poll: an empty snapshot, and the log turns on
    req = make_request(8, seed=1)
    _store(pool, reg, req, [0, 1])
    aborted = _store(pool, reg, req, [2], commit=False)
    pool.abort_store(reg.namespace_id, aborted)
    _store(pool, reg, req, [3], commit=False)  # reserved, never committed
    feed.poll()
    events = feed.take()
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockStored"]
    assert [e.block_hashes for e in events] == [
        ext_hashes(req.block_hashes[0:2]),
        ext_hashes(req.block_hashes[2:4]),
    ]
    assert [e.parent_block_hash for e in events] == [None, *ext_hashes(req.block_hashes[1:2])]
    assert all(e.medium == "CPU" and e.block_size == BLOCK and e.group_idx == 0 for e in events)
    assert events[1].token_ids == req.all_token_ids[8:16]
    assert feed.take() == []  # taken once


def test_evictions_are_announced_removed_with_the_blocks_hashes(pool_reg):
    pool, reg = pool_reg
    feed = _feed(pool, reg)
    feed.poll()
    slots = pool.stats().namespaces[0].slot_count
    reqs = [make_request(2 * CHUNK_BLOCKS, seed=s) for s in range(1, 7)]  # 12 chunks
    for r in reqs:
        _store(pool, reg, r, [0, 1])
        feed.poll()  # the engine's feed polls every 100 ms: here after each store
    events = feed.take()
    stored = [e for e in events if type(e).__name__ == "BlockStored"]
    removed = [e for e in events if type(e).__name__ == "BlockRemoved"]
    evicted = pool.stats().namespaces[0].evicted_blocks
    assert len(stored) == 12 and len(removed) == evicted == 12 - slots >= 4
    # LRU: the oldest chunks left, with exactly the hashes they were stored with
    in_order = [ext_hashes(r.block_hashes[i : i + 2]) for r in reqs for i in (0, 2)]
    assert [e.block_hashes for e in removed] == in_order[: 12 - slots]
    assert all(e.medium == "CPU" for e in removed)
    assert len(feed.announced) == pool.stats().namespaces[0].committed_slots == slots


def test_a_block_stored_and_evicted_between_two_polls_is_announced_neither_way(pool_reg):
    pool, reg = pool_reg
    feed = _feed(pool, reg)
    feed.poll()
    slots = pool.stats().namespaces[0].slot_count
    reqs = [make_request(2 * CHUNK_BLOCKS, seed=s) for s in range(1, 7)]  # 12 chunks
    for r in reqs:
        _store(pool, reg, r, [0, 1])
    feed.poll()
    events = feed.take()
    assert [type(e).__name__ for e in events] == ["BlockStored"] * slots
    in_order = [tuple(ext_hashes(r.block_hashes[i : i + 2])) for r in reqs for i in (0, 2)]
    assert {tuple(e.block_hashes) for e in events} == set(in_order[-slots:])  # LRU's survivors


def test_a_new_feed_gets_a_snapshot_of_what_the_pool_holds_in_pages(pool_reg):
    pool, reg = pool_reg
    first = _feed(pool, reg)
    first.poll()
    reqs = [make_request(2 * CHUNK_BLOCKS, seed=s) for s in range(1, 6)]  # 10 chunks, 8 slots
    for r in reqs:
        _store(pool, reg, r, [0, 1])
    first.poll()
    # a fresh engine on the warm pool: pages of 3 events, one snapshot
    fresh = _feed(pool, reg, page_events=3)
    fresh.poll()
    stored = fresh.take()
    assert {tuple(e.block_hashes) for e in stored} == {
        tuple(ext_hashes(r.block_hashes[i : i + 2])) for r in reqs[1:] for i in (0, 2)
    }
    assert all(type(e).__name__ == "BlockStored" for e in stored)
    assert fresh.polls >= 3  # 8 events in pages of 3
    assert fresh.announced.keys() == first.announced.keys()


def test_a_feed_on_a_new_log_announces_what_is_gone(pool_reg, small_spec):
    """Another log (here: the pool file truncated and rebuilt; a restarted sidecar alike): a
    snapshot, and removals for what the feed had announced and the pool no longer holds."""
    pool, reg = pool_reg
    feed = _feed(pool, reg)
    feed.poll()
    req = make_request(6, seed=9)
    _store(pool, reg, req, [0, 1, 2])
    feed.poll()
    assert len(feed.take()) == 3
    os.truncate(pool.path, 0)
    assert pool.check_file()  # rebuilt: a new generation, the namespace forgotten
    assert pool.wait_ready(30)  # slots come back as the rebuilt file is pre-faulted
    again = pool.register(small_spec(key_size=36), 1, 1 * MiB, "engine/scheduler")
    assert again.namespace_id == reg.namespace_id
    feed.poll()
    events = feed.take()
    assert [type(e).__name__ for e in events] == ["BlockRemoved"] * 3
    assert [e.block_hashes for e in events] == [
        ext_hashes(req.block_hashes[i : i + 2]) for i in (0, 2, 4)
    ]
    assert feed.announced == {}
    assert _store(pool, again, req, [0])
    feed.poll()
    assert [type(e).__name__ for e in feed.take()] == ["BlockStored"]


def test_the_log_overflowing_turns_into_a_snapshot(pool_reg):
    pool, reg = pool_reg
    ns = pool._namespaces[reg.namespace_id]
    ring = sidecar_events.EventLog(ns.slot_count)
    ring._ring = type(ring._ring)(maxlen=4)
    ns.events = ring
    feed = _feed(pool, reg)
    feed.poll()
    reqs = [make_request(2 * CHUNK_BLOCKS, seed=s) for s in range(1, 7)]  # 12 commits, 4 evictions
    for r in reqs:
        _store(pool, reg, r, [0, 1])
    feed.poll()  # its seq fell out of the ring: a snapshot of the 8 held chunks
    events = feed.take()
    assert all(type(e).__name__ == "BlockStored" for e in events)
    assert {tuple(e.block_hashes) for e in events} == {
        tuple(ext_hashes(r.block_hashes[i : i + 2])) for r in reqs[2:] for i in (0, 2)
    }


def test_nothing_is_logged_until_a_feed_asks(pool_reg):
    pool, reg = pool_reg
    req = make_request(4, seed=2)
    _store(pool, reg, req, [0, 1])
    log = pool._namespaces[reg.namespace_id].events
    assert not log.active and len(log._ring) == 0
    assert log.blob_count == 2  # kept for a later snapshot


def test_oversized_or_too_many_announce_blobs_are_refused_before_anything_is_reserved(pool_reg):
    pool, reg = pool_reg
    req = make_request(4, seed=4)
    key = chunk_key(req, 0)
    for announce, needle in (
        ([b"x" * (sidecar_events.MAX_ANNOUNCE_BYTES + 1)], r"announce\[0\] is"),
        ([b""] * (MAX_KEYS_PER_CALL + 1), "blobs, more than"),
    ):
        with pytest.raises(InvalidArgument, match=needle):
            pool.reserve_store(reg.namespace_id, reg.client_id, key, announce)
    ns = pool.stats().namespaces[0]
    assert ns.reserved_slots == 0 and ns.committed_slots == 0  # nothing reserved, nothing lost
    assert _store(pool, reg, req, [0])  # the same key stores fine with a good blob


def test_a_feed_whose_sidecar_cannot_answer_says_so_once_and_catches_up_later(pool_reg, caplog):
    """An older sidecar without Events, or one that is away: the feed's thread says why once,
    keeps asking, and announces what the pool holds once it answers."""
    import logging
    import time

    pool, reg = pool_reg
    answering = {"yes": False}

    def fetch(log_id, after_seq, cursor, max_events):
        if not answering["yes"]:
            raise RuntimeError("events: StatusCode.UNIMPLEMENTED")
        return pool.events(reg.namespace_id, log_id, after_seq, cursor, max_events)

    req = make_request(4, seed=5)
    _store(pool, reg, req, [0, 1])
    feed = EventFeed(fetch, interval_s=0.01)
    with caplog.at_level(logging.DEBUG, logger="kvoffload_connector"):
        feed.start()
        try:
            deadline = time.monotonic() + 5
            while feed.failures < 5:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            answering["yes"] = True
            while len(feed.announced) < 2:
                assert time.monotonic() < deadline, feed.failures
                time.sleep(0.01)
        finally:
            feed.close()
    said = [r for r in caplog.records if r.levelno >= logging.INFO and "event log" in r.message]
    assert len(said) == 1 and "UNIMPLEMENTED" in said[0].message
    assert [type(e).__name__ for e in feed.take()] == ["BlockStored", "BlockStored"]
