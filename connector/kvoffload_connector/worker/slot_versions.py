"""A worker's read-only view of its namespace's slot table: the versions a load checks.

Every slot record in the pool file starts with its state word (kvoffload_sidecar.persist): 0
free, 1 reserved, >= 2 the sequence number of the commit that made it visible, never reused.
The sidecar changes the word (to reserved) before it answers a reservation, so before any
writer touches the slot's bytes. A load therefore copies only bytes stored for its key when
the slot's word, read after the copy completed, equals the word the pin answered: any write
that overlapped the copy was preceded by a change of the word (a seqlock whose writer never
returns to an old value). The worker reads the words through its own mapping of the table
(`RegisterResponse.slot_table_offset`, `slot_record_bytes`); no round trip.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Sequence

import numpy as np

__all__ = ["FIRST_VERSION", "SlotVersions"]

FIRST_VERSION = 2  # state words below are free (0) or reserved (1): never a loadable version


class SlotVersions:
    """The state words of `slot_count` records of `record_bytes` at `offset` of `path`."""

    def __init__(
        self, path: str, offset: int, record_bytes: int, slot_count: int, fd: int | None = None
    ) -> None:
        """`fd`: read the table through a duplicate of it instead of opening `path` (a
        tenant's memfd in node placement; `path` then only names it)."""
        if offset <= 0 or record_bytes < 8 or record_bytes % 8 or slot_count < 1:
            raise ValueError(
                f"no slot table at offset {offset} ({record_bytes}-byte records, {slot_count})"
            )
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        self.end = offset + record_bytes * slot_count
        self._fd = os.dup(fd) if fd is not None else os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._mm = mmap.mmap(
                self._fd, self.end - start, mmap.MAP_SHARED, mmap.PROT_READ, offset=start
            )
        except OSError:
            os.close(self._fd)
            raise
        words = np.frombuffer(self._mm, np.uint64, (self.end - offset) // 8, offset - start)
        self._state = words.reshape(slot_count, record_bytes // 8)[:, 0]
        self.slot_count = slot_count

    def intact(self) -> bool:
        """The file still covers the table (reading a page past its end would be SIGBUS)."""
        try:
            return self._fd >= 0 and os.fstat(self._fd).st_size >= self.end
        except OSError:
            return False

    def matches(self, slots: Sequence[int], versions: Sequence[int]) -> bool:
        """Every slot's state word equals its version, and each version is a commit's."""
        if len(slots) != len(versions) or not self.intact():
            return False
        if not len(slots):
            return True
        want = np.asarray(versions, np.uint64)
        if int(want.min()) < FIRST_VERSION:
            return False
        idx = np.asarray(slots, np.intp)
        if int(idx.min()) < 0 or int(idx.max()) >= self.slot_count:
            return False
        return bool(np.array_equal(self._state[idx], want))

    def close(self) -> None:
        if self._fd >= 0:
            self._state = np.zeros(0, np.uint64)
            with contextlib.suppress(BufferError):  # a view still out: it goes with the object
                self._mm.close()
            os.close(self._fd)
            self._fd = -1
