"""What the event tests share (test_events.py, test_event_publish.py): requests shaped as vLLM's,
their pool keys and announce blobs.

A plain module imported by its package path (`tests.sidecar.event_helpers`), never through
`conftest`: with several suites in one pytest process, `conftest` names whichever suite's
conftest was imported first.
"""

from __future__ import annotations

from types import SimpleNamespace

from kvoffload_connector.scheduler.events import announce_blob
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

MiB = 1 << 20
BLOCK = 4  # tokens per GPU block in these tests
CHUNK_BLOCKS = 2


def ext_hashes(hashes) -> list:
    """Hashes as vLLM's events carry them (ints by default: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)."""
    return [maybe_convert_block_hash(h) for h in hashes]


def make_request(n_blocks: int, seed: int, salt: str | None = None) -> SimpleNamespace:
    """What announce_blob reads of a vLLM Request (hashes chained like vLLM's: distinct)."""
    tokens = [seed * 1000 + i for i in range(n_blocks * BLOCK)]
    return SimpleNamespace(
        block_hashes=[bytes([seed, b]) * 16 for b in range(n_blocks)],
        all_token_ids=tokens,
        lora_request=None,
        cache_salt=salt,
        mm_features=[],
        prompt_embeds=None,
    )


def chunk_key(request: SimpleNamespace, chunk: int) -> bytes:
    """The pool key of a chunk (keys.py: the chunk's last block hash + the group)."""
    return bytes(request.block_hashes[(chunk + 1) * CHUNK_BLOCKS - 1]) + (0).to_bytes(4, "big")


def chunk_blob(request: SimpleNamespace, chunk: int) -> bytes:
    return announce_blob(request, 0, chunk * CHUNK_BLOCKS, CHUNK_BLOCKS, BLOCK)
