"""The presence map: a file the connector's scheduler reads to answer most misses without a
round trip.

One byte per bucket; a key's bucket is the low bits of its first 8 bytes (little endian: a
vLLM block hash, uniform). The sidecar sets a key's byte when a store reserves it, before the
key can be committed, so every key in the index has its byte set: a zero byte means "not in
the pool" for sure, and the scheduler skips the lookup. A set byte means "maybe": the lookup
goes out as before. Eviction clears nothing (a stale byte costs one lookup); once stale bytes
pile up, `rebuild` writes the live keys into the other half and flips the header's `active`
word, so a reader never sees a half-written map.

Layout (little endian): magic `KVOPRES1`, u32 version, u32 bucket bits, u32 active half (0/1),
padding to 64 bytes, then two halves of 2**bits bytes. The file sits beside the socket (the
run dir, a Memory emptyDir of 16Mi): 2 x 1 MiB by default.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from pathlib import Path

import numpy as np

from kvoffload_sidecar import filemode

MAGIC = b"KVOPRES1"
VERSION = 1
HEADER = struct.Struct("<8sIII")
HEADER_BYTES = 64
ACTIVE_OFFSET = 16
DEFAULT_BITS = 20


class PresenceMap:
    """The writer (the pool calls it under its lock)."""

    def __init__(self, path: Path, bits: int = DEFAULT_BITS) -> None:
        if not 8 <= bits <= 24:
            raise ValueError(f"bucket bits must be in 8..24, got {bits}")
        self.path = path
        self.bits = bits
        self.size = 1 << bits
        self._mask = np.uint64(self.size - 1)
        # a fresh file renamed into place: a reader never maps a half-written header, and a
        # connector of the previous instance keeps its own (frozen) file until it registers again
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, filemode.read_mode())
        try:
            os.fchmod(fd, filemode.read_mode())
            os.ftruncate(fd, HEADER_BYTES + 2 * self.size)
            self._mm = mmap.mmap(fd, HEADER_BYTES + 2 * self.size)
        finally:
            os.close(fd)
        self._mm[: HEADER.size] = HEADER.pack(MAGIC, VERSION, bits, 0)
        self._bytes = np.frombuffer(self._mm, np.uint8)
        self._active = 0
        self.marks_since_rebuild = 0
        os.replace(tmp, path)

    def _half(self, which: int) -> np.ndarray:
        start = HEADER_BYTES + which * self.size
        return self._bytes[start : start + self.size]

    def _buckets(self, packed: bytes, key_size: int) -> np.ndarray:
        n = len(packed) // key_size
        keys = np.frombuffer(packed, np.uint8, count=n * key_size).reshape(n, key_size)
        heads = np.zeros((n, 8), np.uint8)  # a key under 8 bytes reads as zero-padded (LE)
        heads[:, : min(8, key_size)] = keys[:, :8]
        return (heads.view("<u8").ravel() & self._mask).astype(np.intp)

    def mark_packed(self, packed: bytes, key_size: int) -> None:
        """Set the buckets of `key_size`-byte keys packed back to back."""
        if packed:
            self._half(self._active)[self._buckets(packed, key_size)] = 1
            self.marks_since_rebuild += len(packed) // key_size

    def rebuild_due(self, live_keys: int) -> bool:
        """Stale marks outnumber live keys enough that a rebuild pays for itself."""
        return self.marks_since_rebuild > max(4 * live_keys, self.size // 8)

    def rebuild(self, live: list[tuple[bytes, int]]) -> None:
        """Only the live keys ((packed keys, key size) per namespace), in the other half, then
        flip: readers switch at their next lookup."""
        other = 1 - self._active
        half = self._half(other)
        half[:] = 0
        for packed, key_size in live:
            if packed:
                half[self._buckets(packed, key_size)] = 1
        self._mm[ACTIVE_OFFSET : ACTIVE_OFFSET + 4] = struct.pack("<I", other)
        self._active = other
        self.marks_since_rebuild = 0

    def set_buckets(self) -> int:
        return int(np.count_nonzero(self._half(self._active)))

    def close(self, unlink: bool = True) -> None:
        self._bytes = np.zeros(0, np.uint8)
        self._mm.close()
        if unlink:
            with contextlib.suppress(OSError):
                self.path.unlink()
