"""Reuse gating for eager stores (`store_threshold`, as vLLM's OffloadingConnector names it).

Eager mode stores every chunk a request computes. Chunks that are never asked for again (unique
suffixes, one-off prompts) then cost PCIe bandwidth, a gather kernel's SMs and pool slots for
nothing. With a threshold N >= 2 a chunk is stored only once N requests of this engine have
asked for it: the N-th computes it (or finds it in the GPU cache) and stores it, so a prompt
seen once costs no store at all.

Counts are per chunk key (the hash of the chunk's last block, which covers the whole prefix up
to it), once per request, so a waiting request visited many times counts once. A request's
chunks are a prefix chain: every request asking for chunk c+1 asks for chunk c too, so counts
never grow along a prompt and the chunks a request may store are a prefix of its chunks. The
table keeps the most recently asked `capacity` keys (least recently asked dropped first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvoffload_connector.common.config import AUTO

DEFAULT_CAPACITY = 64_000  # keys (vLLM's max_tracker_size default)
AUTO_WINDOW = 64  # requests in a row that repeat nothing before `auto` gates
AUTO_THRESHOLD = 2  # what `auto` stores while it gates: chunks asked for twice


class ReuseTracker:
    def __init__(
        self, threshold: int | str, capacity: int = DEFAULT_CAPACITY, window: int = AUTO_WINDOW
    ):
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.auto = threshold == AUTO
        self.threshold = AUTO_THRESHOLD if self.auto else int(threshold)
        self.capacity = capacity
        self.window = window
        self._counts: OrderedDict[bytes, int] = OrderedDict()
        self._stored: OrderedDict[bytes, None] = OrderedDict()  # auto: chunks planned to store
        self._since_repeat = 0  # auto: requests in a row that asked for no chunk seen before

    @property
    def enabled(self) -> bool:
        """Counting: a fixed threshold of 2 or more, or `auto`."""
        return self.auto or self.threshold >= 2

    @property
    def gating(self) -> bool:
        """Chunks asked for fewer than `threshold` times are not stored now."""
        if self.auto:
            return self._since_repeat > self.window
        return self.threshold >= 2

    def count(self, keys: Sequence[bytes]) -> None:
        """One request asked for these chunks (call once per request)."""
        counts = self._counts
        if self.auto and keys:  # the first chunk: any repeat of a prefix chain repeats it
            self._since_repeat = 0 if keys[0] in counts else self._since_repeat + 1
        for key in keys:
            n = counts.pop(key, 0) + 1
            counts[key] = n  # most recently asked last
        while len(counts) > self.capacity:
            counts.popitem(last=False)

    def mark_stored(self, keys: Sequence[bytes]) -> None:
        """`auto`: these chunks are planned for a store (first_unstored skips them later)."""
        if not self.auto:
            return
        stored = self._stored
        for key in keys:
            stored.pop(key, None)
            stored[key] = None
        while len(stored) > self.capacity:
            stored.popitem(last=False)

    def times(self, key: bytes) -> int:
        return self._counts.get(key, 0)

    def storable(self, keys: Sequence[bytes], gated: bool | None = None) -> int:
        """How many of `keys` (a request's chunks, in order) have been asked for often enough;
        `gated`: whether the gate was closed when the request came (default: now)."""
        if not (self.gating if gated is None else gated):
            return len(keys)
        for i, key in enumerate(keys):
            if self._counts.get(key, 0) < self.threshold:
                return i
        return len(keys)

    def first_unstored(self, keys: Sequence[bytes]) -> int:
        """Of the first chunks of a request found in the GPU cache: the first one no earlier
        request can have stored, because this request is the one that brought it to the
        threshold (earlier requests, below it, skipped it). len(keys) when none is. `auto`
        (whose threshold moves): the first one no request planned to store."""
        if not self.enabled:
            return len(keys)
        if self.auto:
            return next((i for i, key in enumerate(keys) if key not in self._stored), len(keys))
        for i, key in enumerate(keys):
            if self._counts.get(key, 0) <= self.threshold:
                return i
        return len(keys)
