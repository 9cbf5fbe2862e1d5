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

DEFAULT_CAPACITY = 64_000  # keys (vLLM's max_tracker_size default)


class ReuseTracker:
    def __init__(self, threshold: int, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.threshold = threshold
        self.capacity = capacity
        self._counts: OrderedDict[bytes, int] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.threshold >= 2

    def count(self, keys: Sequence[bytes]) -> None:
        """One request asked for these chunks (call once per request)."""
        counts = self._counts
        for key in keys:
            n = counts.pop(key, 0) + 1
            counts[key] = n  # most recently asked last
        while len(counts) > self.capacity:
            counts.popitem(last=False)

    def times(self, key: bytes) -> int:
        return self._counts.get(key, 0)

    def storable(self, keys: Sequence[bytes]) -> int:
        """How many of `keys` (a request's chunks, in order) have been asked for often enough."""
        if not self.enabled:
            return len(keys)
        for i, key in enumerate(keys):
            if self._counts.get(key, 0) < self.threshold:
                return i
        return len(keys)

    def first_unstored(self, keys: Sequence[bytes]) -> int:
        """Of the first chunks of a request found in the GPU cache: the first one no earlier
        request can have stored, because this request is the one that brought it to the
        threshold (earlier requests, below it, skipped it). len(keys) when none is."""
        if not self.enabled:
            return len(keys)
        for i, key in enumerate(keys):
            if self._counts.get(key, 0) <= self.threshold:
                return i
        return len(keys)
