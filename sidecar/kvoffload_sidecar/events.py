"""The block-event log of one namespace: which keys became visible and which were evicted.

Why: routers (llm-d's indexer, Dynamo, vLLM's production stack) learn a tier only from vLLM's KV
events. The sidecar is the one place that knows when a block became visible (every rank
committed) and when it left (eviction), and it outlives engines: a fresh engine on a warm pool
asks for a snapshot and announces what the pool holds. What the events say about a block (vLLM's
block hashes, tokens, parent) is an opaque `announce` blob the connector sent with the
reservation; the sidecar keeps it beside the key and never parses it.

Cost: nothing is logged until a connector first asks (`active`), so a pod without
`--kv-events-config` pays one attribute test per commit and eviction. Memory: one blob per
committed key (about a kilobyte for 256 tokens) and a ring of (seq, removed, key) entries.
The pool calls every method with its lock held.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvoffload_sidecar.errors import InvalidArgument
from kvoffload_sidecar.keys import MAX_KEYS_PER_CALL, PoolKey

MIN_RING = 4096
MAX_ANNOUNCE_BYTES = 256 << 10  # a 2,048-token chunk's blob is ~12 KiB: room for larger ones
SNAPSHOT_TTL_S = 60.0  # a snapshot a client stopped paging through is dropped after this
MAX_SNAPSHOTS = 4


def check_announce(announce: Sequence[bytes]) -> None:
    """Bad input is refused before anything is reserved: at most one blob per key of a call,
    each at most MAX_ANNOUNCE_BYTES (the sidecar keeps them while the block is held)."""
    if len(announce) > MAX_KEYS_PER_CALL:
        raise InvalidArgument(f"announce has {len(announce)} blobs, more than {MAX_KEYS_PER_CALL}")
    for i, blob in enumerate(announce):
        if len(blob) > MAX_ANNOUNCE_BYTES:
            raise InvalidArgument(
                f"announce[{i}] is {len(blob)} bytes, more than {MAX_ANNOUNCE_BYTES}"
            )


@dataclass(frozen=True)
class BlockEvent:
    seq: int
    removed: bool
    key: PoolKey
    announce: bytes  # b"" for a removal, or a stored key whose blob is not known (adopted)


@dataclass(frozen=True)
class EventPage:
    """One answer to `Events`: log entries after the client's seq, or a page of a snapshot.

    A client whose `log_id` differs (another sidecar instance, a rebuilt pool, a new
    namespace) or whose seq fell out of the ring gets a snapshot: every committed key, in
    pages (`cursor` names the next page, 0 after the last), then the log from `seq` on."""

    log_id: str
    seq: int  # the log position the client continues from once this page is applied
    snapshot: bool
    events: tuple[BlockEvent, ...]
    cursor: int  # snapshot pages: where the next page starts; 0 when this was the last
    first: bool = False  # the first page of a snapshot: the client starts its tally afresh


@dataclass
class _Snapshot:
    seq: int
    keys: list[PoolKey]
    made: float


class EventLog:
    """Per-namespace log; `announce` blobs live here from reservation to eviction."""

    def __init__(self, slot_count: int, clock=time.monotonic) -> None:
        self.log_id = secrets.token_hex(8)
        self.active = False  # set by the first `page`: only then do commits and evictions log
        self._clock = clock
        self._seq = 0
        self._ring: deque[tuple[int, bool, PoolKey]] = deque(maxlen=max(MIN_RING, 2 * slot_count))
        self._blobs: dict[PoolKey, bytes] = {}
        self._pending: dict[int, dict[PoolKey, bytes]] = {}  # store id -> blobs of its NEW keys
        self._snapshots: dict[int, _Snapshot] = {}
        self._next_snapshot = 1

    # -- what the pool reports -----------------------------------------------------------
    def reserved(self, store_id: int, keys: Sequence[PoolKey], blobs: Sequence[bytes]) -> None:
        """Blobs of a reservation's NEW keys, kept until the store commits or aborts."""
        pending = {k: b for k, b in zip(keys, blobs, strict=False) if b}
        if pending:
            self._pending[store_id] = pending

    def committed(self, store_id: int, keys: Iterable[PoolKey]) -> None:
        pending = self._pending.pop(store_id, None)
        if pending:
            self._blobs.update(pending)
        if self.active:
            for key in keys:
                self._seq += 1
                self._ring.append((self._seq, False, key))

    def aborted(self, store_id: int) -> None:
        self._pending.pop(store_id, None)

    def removed(self, keys: Iterable[PoolKey]) -> None:
        blobs = self._blobs
        if not self.active:
            if blobs:
                for key in keys:
                    blobs.pop(key, None)
            return
        for key in keys:
            blobs.pop(key, None)
            self._seq += 1
            self._ring.append((self._seq, True, key))

    # -- what a connector asks -----------------------------------------------------------
    def page(
        self,
        log_id: str,
        after_seq: int,
        cursor: int,
        max_events: int,
        committed: Iterable[PoolKey],
    ) -> EventPage:
        """The next events for a client at (`log_id`, `after_seq`), or a snapshot page.

        `committed`: every visible key of the namespace (read only when a snapshot starts)."""
        self.active = True
        max_events = max(1, max_events)
        if cursor:
            return self._snapshot_page(cursor, max_events, committed)
        oldest = self._ring[0][0] if self._ring else self._seq + 1
        if log_id != self.log_id or after_seq > self._seq or after_seq + 1 < oldest:
            return self._start_snapshot(list(committed), max_events)
        out: list[BlockEvent] = []
        blobs = self._blobs
        # seqs in the ring are consecutive: the entry after `after_seq` is at a known index
        start = after_seq + 1 - oldest
        for i in range(start, min(len(self._ring), start + max_events)):
            seq, removed, key = self._ring[i]
            out.append(BlockEvent(seq, removed, key, b"" if removed else blobs.get(key, b"")))
        seq = out[-1].seq if out else after_seq
        return EventPage(self.log_id, seq, False, tuple(out), 0)

    def _start_snapshot(self, keys: list[PoolKey], max_events: int) -> EventPage:
        now = self._clock()
        for sid in [s for s, snap in self._snapshots.items() if now - snap.made > SNAPSHOT_TTL_S]:
            del self._snapshots[sid]
        while len(self._snapshots) >= MAX_SNAPSHOTS:
            del self._snapshots[next(iter(self._snapshots))]
        sid = self._next_snapshot
        self._next_snapshot += 1
        self._snapshots[sid] = _Snapshot(self._seq, keys, now)
        return self._snapshot_page(sid << 32, max_events)

    def _snapshot_page(
        self, cursor: int, max_events: int, committed: Iterable[PoolKey] = ()
    ) -> EventPage:
        sid, offset = cursor >> 32, cursor & 0xFFFFFFFF
        snap = self._snapshots.get(sid)
        if snap is None:  # expired or unknown: start again
            return self._start_snapshot(list(committed), max_events)
        chunk = snap.keys[offset : offset + max_events]
        blobs = self._blobs
        events = tuple(BlockEvent(snap.seq, False, k, blobs.get(k, b"")) for k in chunk)
        end = offset + len(chunk)
        first = offset == 0
        if end >= len(snap.keys):
            del self._snapshots[sid]
            return EventPage(self.log_id, snap.seq, True, events, 0, first)
        return EventPage(self.log_id, snap.seq, True, events, (sid << 32) | end, first)

    @property
    def blob_count(self) -> int:
        return len(self._blobs)
