"""The physical KV-cache blocks: reference counts, an LRU free list and the prefix-cache map."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagedllm.core.kv_events import CacheEvent


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Hash of the block's full content once its KV is written; kept after the block is freed
    # (lazy eviction) so a later request can reuse it, dropped when the block is reallocated.
    content_hash: bytes | None = None
    # Prefix-cache hits on this block's content since it was allocated (for the block map).
    reuses: int = 0


class BlockPool:
    """Owns every physical block.

    Free blocks wait in least-recently-used order: allocation takes from the front, freeing
    appends to the back, so freed blocks that still carry a hash stay reusable as long as
    possible.

    Once ``record_events`` is called, every change of the hash map is appended to ``events``
    (see ``kv_events``) until the owner takes them with ``take_events``; replaying them gives
    the hash map's keys exactly. Without it nothing is recorded.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[bytes, int] = {}
        self.events: list[CacheEvent] | None = None
        # Blocks whose reference count is above one, kept as references come and go.
        self.num_shared = 0

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
                if self.events is not None:
                    self.events.append((block.content_hash, None))
            block.content_hash = None
        block.ref_count = 1
        block.reuses = 0
        return block_id

    def acquire(self, block_id: int) -> None:
        """Add a reference to a block already holding data (a prefix hit or a fork)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        elif block.ref_count == 1:
            self.num_shared += 1
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} released more often than acquired")
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
        elif block.ref_count == 1:
            self.num_shared -= 1

    def cached_block(self, content_hash: bytes) -> int | None:
        return self._by_hash.get(content_hash)

    def register(self, block_id: int, content_hash: bytes, parent_hash: bytes) -> None:
        """Record that ``block_id`` holds the KV of content ``content_hash``, whose chain
        continues ``parent_hash`` (the block before it, or the root)."""
        block = self.blocks[block_id]
        if block.content_hash is not None:
            return
        block.content_hash = content_hash
        if content_hash in self._by_hash:
            return  # the first block registered for a content wins; a duplicate stays private
        self._by_hash[content_hash] = block_id
        if self.events is not None:
            self.events.append((content_hash, parent_hash))

    @property
    def cached_hashes(self) -> list[bytes]:
        """Every content hash a new request could reuse, in the order they were registered."""
        return list(self._by_hash)

    def record_events(self) -> None:
        """Record the hash map's changes from now on (see ``take_events``)."""
        if self.events is None:
            self.events = []

    def take_events(self) -> list[CacheEvent]:
        """The changes recorded since the last call, oldest first."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def cached_free(self) -> list[Block]:
        """Free blocks whose content a new request could still reuse (evictable), in the
        order they would be evicted."""
        blocks, by_hash = self.blocks, self._by_hash
        cached = []
        for block_id in self._free:
            h = blocks[block_id].content_hash
            if h is not None and by_hash.get(h) == block_id:
                cached.append(blocks[block_id])
        return cached
