"""PoolView maps a rank's slots of a real shared-memory file, writable and shared."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
import torch
from kvoffload_connector.worker import pool_view
from kvoffload_connector.worker.pool_view import PoolView

PAGE = mmap.ALLOCATIONGRANULARITY


@pytest.fixture
def pool_file(tmp_path):
    """A 64-page file of random bytes (in /dev/shm when present, like the sidecar's emptyDir)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    path = os.path.join(base, f"kvoffload-test-{os.getpid()}-{id(tmp_path)}.shm")
    data = np.random.default_rng(0).integers(0, 256, 64 * PAGE, dtype=np.uint8)
    with open(path, "wb") as f:
        f.write(data.tobytes())
    yield path, data
    os.unlink(path)


def test_maps_exactly_the_rank_region_and_writes_reach_the_file(pool_file):
    path, data = pool_file
    offset, slot_bytes, slot_count = 3 * PAGE, 1040, 50
    view = PoolView.open(path, offset, slot_bytes, slot_count)
    try:
        assert view.tensor.shape == (slot_count, slot_bytes)
        assert view.tensor.dtype == torch.uint8
        assert view.base_ptr == view.tensor.data_ptr()
        np.testing.assert_array_equal(
            view.tensor.reshape(-1).numpy(), data[offset : offset + slot_bytes * slot_count]
        )
        # a write through the tensor is in the file and in a second mapping of it
        view.tensor[7].fill_(0xAB)
        other = PoolView.open(path, offset, slot_bytes, slot_count)
        assert bool((other.tensor[7] == 0xAB).all())
        other.close()
        with open(path, "rb") as f:
            f.seek(offset + 7 * slot_bytes)
            assert f.read(slot_bytes) == b"\xab" * slot_bytes
            f.seek(offset + 8 * slot_bytes)
            assert f.read(16) == data[offset + 8 * slot_bytes :][:16].tobytes()
    finally:
        view.close()


def test_cpu_is_ready_and_close_is_safe_with_views_outstanding(pool_file):
    path, _ = pool_file
    view = PoolView.open(path, 0, 4096, 4)
    assert view.ready
    view.start_device_registration(torch.device("cpu"))
    assert view.ready and view.wait_ready(1) and view.error == ""
    held = view.tensor[1]
    view.close()
    assert not view.ready
    assert held.shape == (4096,)  # still mapped while referenced
    del held


@pytest.mark.parametrize(
    ("offset", "slot_bytes", "slot_count", "message"),
    [
        (100, 1024, 4, "page size"),
        (0, 0, 4, "must be > 0"),
        (0, 1024, -1, "must be > 0"),
        (60 * PAGE, 4096, 8, "need"),
    ],
)
def test_bad_geometry_raises(pool_file, offset, slot_bytes, slot_count, message):
    path, _ = pool_file
    with pytest.raises(ValueError, match=message):
        PoolView.open(path, offset, slot_bytes, slot_count)


def test_missing_file_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        PoolView.open(str(tmp_path / "nope.shm"), 0, 4096, 1)


def test_registration_pieces_fall_on_slot_and_page_boundaries(pool_file, monkeypatch):
    monkeypatch.setattr(pool_view, "REGISTER_PIECE_BYTES", 5 * PAGE)
    path, _ = pool_file
    slot_bytes = 3 * 1024  # lcm(slot, page) = 3 pages = 4 slots; 5 pages hold one such unit
    view = PoolView.open(path, 0, slot_bytes, 61)
    try:
        pieces = view.pieces()
        assert view.piece_bytes == 3 * PAGE
        assert pieces[0] == (0, 4) and pieces[-1] == (60, 61) and len(pieces) == 16
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:], strict=False))
        for first, _ in pieces:
            assert (first * slot_bytes) % PAGE == 0
    finally:
        view.close()
    small = PoolView.open(path, 0, 4096, 12)
    try:
        assert small.pieces() == [(0, 5), (5, 10), (10, 12)]
    finally:
        small.close()


def test_opened_inside_inference_mode_the_tensor_stays_writable_elsewhere(pool_file):
    """vLLM calls into the connector under inference_mode; engine threads write outside it."""
    path, _ = pool_file
    with torch.inference_mode():
        view = PoolView.open(path, 0, 4096, 4)
    try:
        assert not view.tensor.is_inference()
        view.tensor[2].fill_(7)  # an inference tensor would raise here
        assert int(view.tensor[2, 100]) == 7
    finally:
        view.close()
