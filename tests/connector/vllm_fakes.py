"""Stand-ins for the vLLM objects the connector's scheduler half reads (no vLLM needed).

Requests, GPU blocks, the block pool with its free queue, the KV cache manager and the
scheduler output, with the fields and rules of vLLM's own objects that the scheduler and the
store planner use. Shared by the scheduler scenarios (test_scheduler.py) and the slot-protocol
model checker (tests/model/).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

BS = 32  # tokens per GPU block
CHUNK = 64  # tokens per chunk: 2 blocks


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    is_null: bool = False
    block_hash: bytes | None = None
    prev_free_block: Block | None = None
    next_free_block: Block | None = None


class FreeQueue:
    def __init__(self, blocks: list[Block]):
        self.fake_free_list_head = Block(-1)
        self.fake_free_list_tail = Block(-2)
        self.items: list[Block] = list(blocks)
        self._link()

    def _link(self) -> None:
        chain = [self.fake_free_list_head, *self.items, self.fake_free_list_tail]
        for a, b in zip(chain, chain[1:], strict=False):
            a.next_free_block, b.prev_free_block = b, a

    def remove(self, b: Block) -> None:
        self.items.remove(b)
        self._link()

    def append(self, b: Block) -> None:
        self.items.append(b)
        self._link()


class BlockPool:
    def __init__(self, n: int):
        self.num_gpu_blocks = n
        self.blocks = [Block(i) for i in range(n)]
        self.blocks[0].is_null = True
        self.free_block_queue = FreeQueue(self.blocks[1:])

    def get_num_free_blocks(self) -> int:
        return len(self.free_block_queue.items)

    def touch(self, blocks):
        for b in blocks:
            if b.ref_cnt == 0 and not b.is_null:
                self.free_block_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, blocks):
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0 and not b.is_null:
                self.free_block_queue.append(b)

    def reset_prefix_cache(self) -> bool:
        """vLLM's rule: only when every block but the null one is free."""
        if self.num_gpu_blocks - self.get_num_free_blocks() != 1:
            return False
        for b in self.blocks:
            b.block_hash = None
        return True

    def allocate(self, n: int) -> list[Block]:
        got = self.free_block_queue.items[:n]
        for b in got:
            self.free_block_queue.remove(b)
            b.ref_cnt = 1
            b.block_hash = None
        return got


class KVCacheManager:
    def __init__(self, pool: BlockPool):
        self.block_pool = pool
        self.req_blocks: dict[str, list[list[Block]]] = {}

    def get_block_ids(self, req_id):
        return tuple([b.block_id for b in g] for g in self.req_blocks[req_id])


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        h = b""
        for i in range(len(self.prompt) // BS):
            h = hashlib.sha256(h + bytes(str(self.prompt[i * BS : (i + 1) * BS]), "ascii")).digest()
            self.block_hashes.append(h)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)


@dataclass
class KVBlocks:
    blocks: tuple[list[Block], ...]


@dataclass
class SchedOut:
    num_scheduled_tokens: dict[str, int]
    preempted_req_ids: set[str] = field(default_factory=set)
