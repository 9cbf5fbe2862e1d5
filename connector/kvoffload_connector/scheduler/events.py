"""KV events for the host tier: vLLM's own BlockStored / BlockRemoved with medium "CPU".

Why: prefix-aware routers (llm-d's indexer, Dynamo's router, vLLM's production stack) score a
pod by the blocks its KV events announced; a tier that announces nothing is invisible to them.
The connector's `take_events()` hands these events to vLLM, which publishes them with the
publisher, topic and replay socket the user configured (`--kv-events-config`), next to the GPU
tier's events, so every existing subscriber consumes them unchanged.

- What a pool chunk announces is computed when its store is planned (`announce_blob`): the
  chunk's GPU blocks, each with vLLM's own block hash (the one the GPU tier's BlockStored
  carried for the same tokens), the parent hash, the tokens and the extra keys (LoRA, cache
  salt), encoded with msgpack. The sidecar keeps the blob beside the key (opaque to it).
- When blocks enter or leave the pool is the sidecar's to say (only it knows when every rank
  committed, and what its eviction took): `EventFeed` follows the namespace's event log over
  gRPC from a daemon thread and turns it into vLLM events. A feed new to the log (a fresh
  engine on a warm pool, a restarted sidecar, a rebuilt pool) reads a snapshot of every visible
  block first: blocks it had announced that are gone are announced removed, the others stored.
- Nothing is announced for a block that never committed (the sidecar logs commits only).
- vLLM publishes what `take_events()` returns only inside an engine step, and an idle engine takes
  none: the last request's blocks would be announced only when the next request comes. So where
  vLLM's own publisher queues each batch to its own thread (`ZmqEventPublisher.publish` is a
  `queue.Queue.put` in every supported version), the feed hands its events to that publisher from
  its poll thread (`publish_through`), in order, one `KVEventBatch` per poll, and `take_events()`
  returns nothing. Another publisher (registered by a plugin) keeps the step path; a publish that
  raises puts the events back for `take_events()` and the step path serves from then on (said
  once).
- A connector cache reset (`reset_connector`, a weight update) moves the engine's pool keys to a
  new epoch, so what the pool holds from before can no longer load here: the feed announces it
  all removed, and blobs carry the epoch they were stored in, so neither the log nor a later
  snapshot announces an older epoch's blocks again.

No torch; msgspec and vLLM's event types are imported lazily (both ship with vLLM).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

MEDIUM = "CPU"
BLOB_VERSION = 1
POLL_INTERVAL_S = 0.1
PAGE_EVENTS = 4096
MAX_PENDING = 1 << 20  # events waiting for take_events (vLLM steps too rarely: drop the oldest)


@dataclass(frozen=True)
class Announced:
    """What was announced of one pool chunk: enough to announce its removal."""

    group: int
    hashes: tuple[bytes, ...]


def announce_blob(
    request: Any, group: int, first_block: int, n_blocks: int, block_size: int, epoch: bytes = b""
) -> bytes:
    """What KV events say of the chunk covering GPU blocks [first_block, first_block+n_blocks)
    of `request` in KV group `group` (encoded for the sidecar to keep), stored in key `epoch`
    (b"": the keys a fresh engine uses)."""
    import msgspec

    hashes = request.block_hashes
    chunk = [bytes(h) for h in hashes[first_block : first_block + n_blocks]]
    parent = bytes(hashes[first_block - 1]) if first_block else None
    tokens = list(
        request.all_token_ids[first_block * block_size : (first_block + n_blocks) * block_size]
    )
    lora = getattr(request, "lora_request", None)
    return msgspec.msgpack.encode(
        [
            BLOB_VERSION,
            group,
            block_size,
            chunk,
            parent,
            tokens,
            getattr(lora, "adapter_id", None) if lora else None,
            getattr(lora, "name", None) if lora else None,
            _extra_keys(request, first_block, n_blocks, block_size),
            epoch,  # a tenth field: readers of the first nine (older connectors) ignore it
        ]
    )


def _extra_keys(request: Any, first_block: int, n_blocks: int, block_size: int) -> Any:
    """Per block, the extra keys vLLM's GPU-tier event carries (None when there are none)."""
    if not (
        getattr(request, "cache_salt", None)
        or getattr(request, "lora_request", None)
        or getattr(request, "mm_features", None)
        or getattr(request, "prompt_embeds", None) is not None
    ):
        return None  # plain text: vLLM's events carry no extra keys (the usual request, fast)
    try:
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys
    except ImportError:  # pragma: no cover - every supported vLLM has it
        return None
    mm_idx = 0
    start = 0 if getattr(request, "mm_features", None) else first_block  # mm: walk from the start
    per_block: list[Any] = []
    for b in range(start, first_block + n_blocks):
        keys, mm_idx = generate_block_hash_extra_keys(
            request, b * block_size, (b + 1) * block_size, mm_idx
        )
        if b >= first_block:
            per_block.append(keys)
    if not any(k is not None for k in per_block):
        return None
    try:
        from vllm.v1.core.kv_cache_utils import to_event_extra_keys
    except ImportError:  # vLLM 0.26 publishes them as they are
        return per_block
    return to_event_extra_keys(per_block)


@dataclass(frozen=True)
class DecodedBlob:
    group: int
    block_size: int
    hashes: tuple[bytes, ...]
    parent: bytes | None
    tokens: list[int]
    lora_id: int | None
    lora_name: str | None
    extra_keys: Any
    epoch: bytes = b""


def decode_blob(blob: bytes) -> DecodedBlob | None:
    """The fields of an `announce_blob`; None for an empty, foreign or newer blob."""
    if not blob:
        return None
    import msgspec

    try:
        fields = msgspec.msgpack.decode(blob)
    except msgspec.DecodeError:
        return None
    if not isinstance(fields, list) or len(fields) < 9 or fields[0] != BLOB_VERSION:
        return None
    _, group, block_size, hashes, parent, tokens, lora_id, lora_name, extra = fields[:9]
    if extra:  # msgpack gives tuples back as lists
        extra = [tuple(k) if k is not None else None for k in extra]
    epoch = fields[9] if len(fields) > 9 and isinstance(fields[9], bytes) else b""
    return DecodedBlob(
        group, block_size, tuple(hashes), parent, tokens, lora_id, lora_name, extra, epoch
    )


class VllmEvents:
    """Builds vLLM's event objects with the fields this vLLM version has."""

    def __init__(self) -> None:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        self._stored, self._removed = BlockStored, BlockRemoved
        self._convert = maybe_convert_block_hash
        self._stored_fields = set(BlockStored.__struct_fields__)
        self._removed_fields = set(BlockRemoved.__struct_fields__)

    def stored(self, b: DecodedBlob) -> Any:
        convert = self._convert
        fields = {
            "block_hashes": [convert(h) for h in b.hashes],
            "parent_block_hash": convert(b.parent) if b.parent is not None else None,
            "token_ids": b.tokens,
            "block_size": b.block_size,
            "lora_id": b.lora_id,
            "medium": MEDIUM,
            "lora_name": b.lora_name,
            "extra_keys": b.extra_keys or None,
            "group_idx": b.group,
        }
        return self._stored(**{k: v for k, v in fields.items() if k in self._stored_fields})

    def removed(self, a: Announced) -> Any:
        fields = {
            "block_hashes": [self._convert(h) for h in a.hashes],
            "medium": MEDIUM,
            "group_idx": a.group,
        }
        return self._removed(**{k: v for k, v in fields.items() if k in self._removed_fields})


class EventFeed:
    """Follows the pool's event log for one namespace and queues vLLM events.

    `fetch(log_id, after_seq, cursor, max_events)` is the client's `events` call; it raises
    when the sidecar is away (the feed keeps its state and asks again: a sidecar that comes
    back with another log answers with a snapshot, and the difference is announced)."""

    def __init__(
        self,
        fetch: Callable[[str, int, int, int], Any],
        *,
        interval_s: float = POLL_INTERVAL_S,
        page_events: int = PAGE_EVENTS,
        builder: VllmEvents | None = None,
    ) -> None:
        self._fetch = fetch
        self._interval = interval_s
        self._page = page_events
        self._build = builder or VllmEvents()
        self.announced: dict[bytes, Announced] = {}
        self.epoch = b""  # blobs of another key epoch are not announced (retire)
        self._lock = threading.Lock()  # the poller's pages against retire()
        self._log_id = ""
        self._seq = 0
        self._snapshot_keys: set[bytes] | None = None  # keys seen in the snapshot being read
        self._cursor = 0
        self._out: collections.deque[Any] = collections.deque(maxlen=MAX_PENDING)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.polls = 0
        self.failures = 0
        self._said = False  # the first events handed to vLLM are logged once
        self._said_failure = False  # so is the first failed poll
        self._publisher: Any = None  # vLLM's publisher, fed from the poll thread
        self._said_step_path = False  # a publisher the feed does not feed itself: said once
        self._batch: Callable[[list[Any]], Any] | None = None
        self.published = 0  # events handed to the publisher directly (tests, debugging)

    # -- publishing without a step -------------------------------------------------------
    def publish_through(self, publisher: Any) -> bool:
        """Hand events to `publisher` (vLLM's scheduler's `kv_event_publisher`) as they
        come, from the poll thread, when it is vLLM's ZMQ publisher: its `publish` only queues
        the batch for its own thread. Anything else (a plugin's publisher, whose thread safety
        is unknown) keeps the step path. True when attached."""
        try:
            from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher
        except ImportError:  # pragma: no cover - every supported vLLM has both
            return False
        if publisher is not None and publisher is self._publisher:
            return True
        if type(publisher) is not ZmqEventPublisher:
            if type(publisher).__name__ != "NullEventPublisher" and not self._said_step_path:
                self._said_step_path = True
                log.info(
                    "kvoffload: KV events: publisher %s is not vLLM's ZMQ publisher; the host "
                    "tier's events go out at engine steps",
                    type(publisher).__name__,
                )
            return False
        with self._lock:
            self._batch = lambda events: KVEventBatch(ts=time.time(), events=events)
            self._publisher = publisher
            self._flush_locked()  # what was queued before (a snapshot read at start)
        return True

    def _flush_locked(self) -> None:
        """Under the lock: queued events to the publisher, in order, as one batch; on a
        failure they stay queued for `take` (the step path), said once."""
        pub, out = self._publisher, self._out
        if pub is None or not out or self._batch is None:
            return
        events = list(out)
        try:
            pub.publish(self._batch(events))
        except Exception as exc:  # noqa: BLE001 - a closed publisher, anything: the step path
            self._publisher = None
            log.info(
                "kvoffload: KV events: vLLM's publisher refused a batch (%s: %s); the host "
                "tier's events go out at engine steps from now on",
                type(exc).__name__,
                exc,
            )
            return
        out.clear()
        self.published += len(events)
        self._say_first(len(events))

    def _say_first(self, n: int) -> None:
        if not self._said:
            self._said = True
            log.info(
                "kvoffload: KV events: announcing the host tier (medium %s) through vLLM's "
                "publisher, %d event(s) in the first batch",
                MEDIUM,
                n,
            )

    # -- the scheduler's side ------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvoffload-events", daemon=True)
            self._thread.start()

    def take(self) -> list[Any]:
        """Events queued since the last call, in order (vLLM's `take_events`); nothing while
        the poll thread publishes them itself (never waiting for its lock then: a publish
        may wait for room in the publisher's queue)."""
        if self._publisher is not None or not self._out:
            return []
        with self._lock:
            taken = list(self._out)
            self._out.clear()
        if taken:
            self._say_first(len(taken))
        return taken

    def retire(self, epoch: bytes) -> int:
        """The engine's keys moved to `epoch` (a connector cache reset): every block announced
        so far is announced removed, and only blobs of `epoch` are announced from now on.
        Returns how many were announced removed."""
        with self._lock:
            self.epoch = epoch
            gone = list(self.announced.values())
            self.announced.clear()
            for a in gone:
                self._out.append(self._build.removed(a))
            self._flush_locked()
            return len(gone)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    # -- the poller ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - the sidecar away, a bad page: ask again
                self.failures += 1
                if not self._said_failure:  # once: an older sidecar without Events says so here
                    self._said_failure = True
                    log.info(
                        "kvoffload: KV events: cannot read the pool's event log yet (%s); the "
                        "host tier's events start once it answers (retrying)",
                        exc,
                    )
                else:
                    log.debug("kvoffload: events poll failed: %s", exc)

    def poll(self) -> int:
        """Read the log until caught up (all snapshot pages included); events queued."""
        queued = 0
        while True:
            page = self._fetch(self._log_id, self._seq, self._cursor, self._page)
            self.polls += 1
            queued += self._apply(page)
            if page.snapshot and page.cursor:
                self._cursor = page.cursor
                continue
            self._cursor = 0
            if not page.snapshot and len(page.events) >= self._page:
                continue  # more log entries than one page
            return queued

    def _apply(self, page: Any) -> int:
        with self._lock:
            queued = self._apply_locked(page)
            self._flush_locked()
            return queued

    def _apply_locked(self, page: Any) -> int:
        before = len(self._out)
        if page.snapshot:
            if page.first or self._snapshot_keys is None or page.log_id != self._log_id:
                self._snapshot_keys = set()
            self._log_id = page.log_id
            for e in page.events:
                self._snapshot_keys.add(bytes(e.key))
                if bytes(e.key) not in self.announced:
                    self._stored(e)
            if not page.cursor:  # the snapshot's last page: what it lacks is gone
                gone = [k for k in self.announced if k not in self._snapshot_keys]
                for key in gone:
                    self._out.append(self._build.removed(self.announced.pop(key)))
                self._snapshot_keys = None
            self._seq = page.seq
            return len(self._out) - before
        for e in page.events:
            key = bytes(e.key)
            if e.removed:
                a = self.announced.pop(key, None)
                if a is not None:
                    self._out.append(self._build.removed(a))
            elif key not in self.announced:  # else already announced (by the snapshot)
                self._stored(e)
        self._seq = page.seq
        return len(self._out) - before

    def _stored(self, e: Any) -> None:
        blob = decode_blob(bytes(e.announce))
        if blob is None or blob.epoch != self.epoch:
            return  # no blob (events off where it was stored, adopted), or keys of another epoch
        self.announced[bytes(e.key)] = Announced(blob.group, blob.hashes)
        self._out.append(self._build.stored(blob))
