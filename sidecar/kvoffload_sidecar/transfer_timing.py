"""Store and load latency as the sidecar sees them, per pool namespace.

A store runs from its reservation (`ReserveStore` answered with a store id) until it becomes
visible (the last rank's `CommitStore`): the connector's copy to the pool plus the commits of
every rank. A load runs from its pin (`ReserveLoad` answered with a pin id) until its `Release`:
the copy from the pool, plus however long the request held the pin before its load ran. The
servicer reports those four events here after the `Pool` call succeeded; nothing here touches
the pool or its lock.

Stores that end otherwise (aborted, or their client gone) and pins dropped by a client's detach
are never observed: `AbortStore` forgets its store, and the open tables are bounded (the oldest
entry goes first), so a client that vanishes costs a bounded number of entries. Ids are unique
per sidecar process (they start at a random base), so a stale entry never matches a later call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

# From a fraction of a millisecond (a one-chunk copy over PCIe) to seconds (a pin held across a
# long step, a store whose ranks commit late on a busy host).
TRANSFER_BUCKETS = (
    5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
MAX_OPEN = 1 << 16  # open stores (and pins) remembered per kind; the oldest go first beyond it
STORE_METRIC = "kvoffload_store_latency_seconds"
LOAD_METRIC = "kvoffload_load_latency_seconds"


class _Open:
    """Start times of open operations keyed by (namespace id, operation id), oldest first."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._started: dict[tuple[str, int], float] = {}

    def add(self, key: tuple[str, int], now: float) -> None:
        started = self._started
        if len(started) >= self._limit:
            del started[next(iter(started))]  # dicts keep insertion order: the oldest
        started[key] = now

    def pop(self, key: tuple[str, int]) -> float | None:
        return self._started.pop(key, None)

    def __len__(self) -> int:
        return len(self._started)


class TransferTimer:
    """Two histograms labelled `pool_namespace`, fed by the servicer's store and pin events.

    Thread-safe: gRPC handlers run on the event loop, framed sessions on their own threads.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        namespace_label: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        limit: int = MAX_OPEN,
    ) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._stores = _Open(limit)
        self._pins = _Open(limit)
        self._children: dict[tuple[bool, str], Any] = {}  # (store?, namespace) -> histogram
        self._store_hist = Histogram(
            STORE_METRIC,
            "Seconds from a store's reservation until it became visible (every rank committed): "
            "the connector's copy into the pool and the ranks' commits.",
            [namespace_label],
            buckets=TRANSFER_BUCKETS,
            registry=registry,
        )
        self._load_hist = Histogram(
            LOAD_METRIC,
            "Seconds from a load's pin until its release: the copy from the pool plus the time "
            "the request held the pin before its load ran.",
            [namespace_label],
            buckets=TRANSFER_BUCKETS,
            registry=registry,
        )

    def store_reserved(self, namespace_id: str, store_id: int) -> None:
        if store_id:
            now = self._clock()
            with self._lock:
                self._stores.add((namespace_id, store_id), now)

    def store_visible(self, namespace_id: str, store_id: int) -> None:
        """The store's last rank committed (a repeated commit finds nothing: observed once)."""
        now = self._clock()
        with self._lock:
            started = self._stores.pop((namespace_id, store_id))
        if started is not None:
            self._child(True, namespace_id).observe(now - started)

    def store_aborted(self, namespace_id: str, store_id: int) -> None:
        with self._lock:
            self._stores.pop((namespace_id, store_id))

    def pinned(self, namespace_id: str, pin_id: int) -> None:
        if pin_id:
            now = self._clock()
            with self._lock:
                self._pins.add((namespace_id, pin_id), now)

    def released(self, namespace_id: str, pin_ids: Iterable[int]) -> None:
        now = self._clock()
        with self._lock:
            started = [self._pins.pop((namespace_id, pin_id)) for pin_id in pin_ids]
        for t0 in started:
            if t0 is not None:
                self._child(False, namespace_id).observe(now - t0)

    def _child(self, store: bool, namespace_id: str) -> Any:
        """The namespace's histogram child (cached: `labels()` costs a lock and a tuple)."""
        child = self._children.get((store, namespace_id))
        if child is None:
            hist = self._store_hist if store else self._load_hist
            child = self._children.setdefault((store, namespace_id), hist.labels(namespace_id))
        return child

    def open_counts(self) -> tuple[int, int]:
        """(open stores, open pins) remembered now (tests)."""
        with self._lock:
            return len(self._stores), len(self._pins)
