"""The event feed publishes through vLLM's own ZMQ publisher from its poll thread.

vLLM hands `take_events()` to its publisher only inside an engine step; an idle engine takes
none, so the last request's blocks would wait for the next request. Here the pool's log pages
as the sidecar's `Events` answers them, a real `ZmqEventPublisher` and a ZMQ subscriber
decoding vLLM's `KVEventBatch`: what a poll reads reaches the subscriber with no
`take_events()` call, and a publisher that refuses a batch sends the feed back to the step
path, losing nothing.
"""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from kvoffload_connector.scheduler.events import EventFeed, announce_blob  # noqa: E402
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher  # noqa: E402

from tests.sidecar.event_helpers import (  # noqa: E402
    BLOCK,
    CHUNK_BLOCKS,
    chunk_key,
    ext_hashes,
    make_request,
)


class _Log:
    """The sidecar's event log of one namespace as `Events` pages it (an empty snapshot
    first, then the commits since `after_seq`)."""

    def __init__(self) -> None:
        self.entries: list[SimpleNamespace] = []

    def commit(self, request: SimpleNamespace, chunks: list[int]) -> None:
        for c in chunks:
            blob = announce_blob(request, 0, c * CHUNK_BLOCKS, CHUNK_BLOCKS, BLOCK)
            self.entries.append(
                SimpleNamespace(key=chunk_key(request, c), removed=False, announce=blob)
            )

    def fetch(self, log_id: str, after_seq: int, cursor: int, max_events: int):
        if not log_id:
            return SimpleNamespace(
                log_id="log-1", seq=len(self.entries), snapshot=True, first=True, cursor=0,
                events=list(self.entries),
            )  # fmt: skip
        return SimpleNamespace(
            log_id=log_id, seq=len(self.entries), snapshot=False, first=False, cursor=0,
            events=self.entries[after_seq:],
        )  # fmt: skip


@pytest.fixture
def log_feed():
    log = _Log()
    return log, EventFeed(log.fetch)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Subscriber:
    def __init__(self, port: int) -> None:
        import msgspec

        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.connect(f"tcp://127.0.0.1:{port}")
        self._sub.setsockopt_string(zmq.SUBSCRIBE, "kv")
        time.sleep(0.5)  # the subscription reaches the publisher (ZMQ's slow joiner)

    def events(self, n: int, timeout_s: float = 5.0) -> list:
        out: list = []
        end = time.monotonic() + timeout_s
        while len(out) < n and time.monotonic() < end:
            if self._sub.poll(50):
                _topic, _seq, payload = self._sub.recv_multipart()
                out.extend(self._decoder.decode(payload).events)
        return out

    def close(self) -> None:
        self._sub.close(0)
        self._ctx.term()


@pytest.fixture
def publisher():
    port = _free_port()
    pub = ZmqEventPublisher(data_parallel_rank=0, endpoint=f"tcp://*:{port}", topic="kv")
    sub = _Subscriber(port)
    yield pub, sub
    sub.close()
    pub.shutdown()


def test_a_poll_publishes_without_take_events_in_order(log_feed, publisher):
    log, feed = log_feed
    pub, sub = publisher
    assert feed.publish_through(pub)
    feed.poll()  # the first poll: an empty snapshot
    req = make_request(6, seed=4)
    log.commit(req, [0, 1])
    feed.poll()  # what the feed's daemon thread does every 100 ms; nobody calls take()
    got = sub.events(2)
    assert [type(e).__name__ for e in got] == ["BlockStored", "BlockStored"]
    assert [e.block_hashes for e in got] == [
        ext_hashes(req.block_hashes[0:2]),
        ext_hashes(req.block_hashes[2:4]),
    ]
    assert all(e.medium == "CPU" for e in got)
    assert feed.take() == [] and feed.published == 2
    # a connector cache reset announces them removed through the same path, after them
    assert feed.retire(b"epoch-2") == 2
    removed = sub.events(2)
    assert [type(e).__name__ for e in removed] == ["BlockRemoved", "BlockRemoved"]
    assert feed.take() == []


def test_a_refused_batch_goes_back_to_the_step_path(log_feed, publisher, caplog):
    log, feed = log_feed
    pub, _ = publisher
    assert feed.publish_through(pub)
    feed.poll()
    pub.shutdown()  # vLLM's scheduler shuts its publisher down before the connector
    req, more = make_request(4, seed=5), make_request(2, seed=6)
    log.commit(req, [0, 1])
    with caplog.at_level("INFO", logger="kvoffload_connector.scheduler.events"):
        feed.poll()
        log.commit(more, [0])
        feed.poll()
    events = feed.take()
    assert [e.block_hashes for e in events] == [
        ext_hashes(req.block_hashes[0:2]),
        ext_hashes(req.block_hashes[2:4]),
        ext_hashes(more.block_hashes[0:2]),
    ]
    assert sum("refused a batch" in r.getMessage() for r in caplog.records) == 1


def test_a_publisher_of_unknown_thread_safety_keeps_the_step_path(log_feed):
    log, feed = log_feed

    class PluginPublisher:
        def publish(self, batch) -> None:
            raise AssertionError("published from the poll thread")

    assert not feed.publish_through(PluginPublisher())
    feed.poll()
    log.commit(make_request(2, seed=7), [0])
    feed.poll()
    assert len(feed.take()) == 1
