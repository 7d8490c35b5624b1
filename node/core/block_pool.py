"""The physical KV-cache blocks: reference counts, an LRU free list and the prefix-cache map."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Hash of the block's full content once its KV is written; kept after the block is freed
    # (lazy eviction) so a later request can reuse it, dropped when the block is reallocated.
    content_hash: bytes | None = None


class BlockPool:
    """Owns every physical block.

    Free blocks wait in least-recently-used order: allocation takes from the front, freeing
    appends to the back, so freed blocks that still carry a hash stay reusable as long as
    possible.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[bytes, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self.blocks) - len(self._free)

    def allocate(self) -> int:
        """Take the least recently used free block, evicting its cached hash."""
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.content_hash is not None:
            if self._by_hash.get(block.content_hash) == block_id:
                del self._by_hash[block.content_hash]
            block.content_hash = None
        block.ref_count = 1
        return block_id

    def acquire(self, block_id: int) -> None:
        """Add a reference to a block already holding data (a prefix hit or a fork)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} released more often than acquired")
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None

    def cached_block(self, content_hash: bytes) -> int | None:
        return self._by_hash.get(content_hash)

    def register(self, block_id: int, content_hash: bytes) -> None:
        """Record that ``block_id`` holds the KV of content ``content_hash``."""
        block = self.blocks[block_id]
        if block.content_hash is not None:
            return
        block.content_hash = content_hash
        # The first block registered for a content wins; a duplicate stays private.
        self._by_hash.setdefault(content_hash, block_id)

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free
