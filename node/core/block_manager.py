"""Block tables for sequences: allocation on demand, prefix caching, fork and copy-on-write."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from pagedllm.core.block_pool import BlockPool
from pagedllm.core.sequence import BlockTable, Sequence


def root_hash(seed: int, adapter: tuple[str, str] | None = None) -> bytes:
    """The parent of a sequence's first block: the seed's, or a LoRA adapter's own (its K/V
    differs from the base model's for the same tokens, so no block is shared across them).
    ``adapter``: ``LoRARequest.key``, (name, directory), which a router learns from the feed."""
    tail = "" if adapter is None else ":lora:" + "@".join(adapter)
    key = f"pagedllm-prefix-root:{seed}{tail}"
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """Identity of a full block: its parent's hash and its tokens."""
    return _digest(parent, np.asarray(token_ids, dtype=np.int64).tobytes())


def chained_hashes(parent: bytes, token_ids: list[int], block_size: int) -> list[bytes]:
    """``block_hash`` of each full block of ``token_ids`` in turn, each the next one's parent.
    The tokens are converted once, not block by block (a third of the time on long prompts)."""
    count = len(token_ids) // block_size
    data = np.asarray(token_ids[: count * block_size], dtype=np.int64).tobytes()
    step = 8 * block_size  # int64
    hashes: list[bytes] = []
    for start in range(0, len(data), step):
        parent = _digest(parent, data[start : start + step])
        hashes.append(parent)
    return hashes


def _digest(parent: bytes, token_bytes: bytes) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(token_bytes)
    return h.digest()


@dataclass
class PrefixHit:
    block_ids: list[int]
    num_tokens: int


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, seed: int = 0
    ) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._seed = seed
        self._roots: dict[tuple[str, str] | None, bytes] = {None: root_hash(seed)}
        # (src, dst) copies the workers must make before the next forward pass.
        self.pending_copies: list[tuple[int, int]] = []
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (cached free blocks count as free)."""
        return self.pool.num_used / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _root(self, seq: Sequence) -> bytes:
        lora = seq.request.lora
        key = None if lora is None else lora.key
        root = self._roots.get(key)
        if root is None:
            root = self._roots[key] = root_hash(self._seed, key)
        return root

    def _full_block_hashes(self, seq: Sequence) -> list[bytes]:
        """Hashes of the sequence's full blocks, extended as tokens arrive."""
        bs = self.block_size
        hashes = seq.blocks.hashes
        done = len(hashes) * bs
        if seq.num_tokens - done >= bs:
            parent = hashes[-1] if hashes else self._root(seq)
            hashes.extend(chained_hashes(parent, seq.token_ids[done : seq.num_tokens], bs))
        return hashes

    def find_prefix(self, seq: Sequence) -> PrefixHit:
        """The longest run of the sequence's leading full blocks already in the cache."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return PrefixHit([], 0)
        hit: list[int] = []
        for h in self._full_block_hashes(seq):
            block_id = self.pool.cached_block(h)
            if block_id is None:
                break
            hit.append(block_id)
        return PrefixHit(hit, len(hit) * self.block_size)

    def _layout(self, seq: Sequence, hit: PrefixHit | None) -> tuple[list[int], int, int]:
        """(block table, computed tokens, tokens with K/V) the sequence would start from."""
        if hit is not None and hit.block_ids:
            # Keep at least one token to compute, for the logits of the next token.
            return hit.block_ids, min(hit.num_tokens, seq.num_tokens - 1), hit.num_tokens
        return seq.blocks.ids, seq.num_computed_tokens, seq.num_kv_tokens

    def _copy_target(self, table: list[int], computed: int, kv_tokens: int) -> int | None:
        """Index of a shared block the next write lands in (it must be copied first)."""
        index = max(computed, kv_tokens) // self.block_size
        if index < len(table) and self.pool.blocks[table[index]].ref_count > 1:
            return index
        return None

    def can_allocate(
        self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> bool:
        table, computed, kv_tokens = self._layout(seq, hit)
        end = max(computed + num_new_tokens, kv_tokens)
        take = max(0, self.blocks_needed(end) - len(table))
        if hit is not None:
            take += sum(1 for b in hit.block_ids if self.pool.is_free(b))
        take += self._copy_target(table, computed, kv_tokens) is not None
        return take <= self.pool.num_free

    def allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Give ``seq`` the blocks to compute ``num_new_tokens`` more tokens.

        ``hit`` is given when a waiting sequence (holding no blocks) is admitted: its blocks
        are shared and the sequence starts computing after them. Returns False and changes
        nothing when the free blocks do not suffice.
        """
        if not self.can_allocate(seq, num_new_tokens, hit):
            return False
        if hit is not None:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += hit.num_tokens
            for block_id in hit.block_ids:
                self.pool.acquire(block_id)
                self.pool.blocks[block_id].reuses += 1
            table, seq.num_computed_tokens, seq.num_kv_tokens = self._layout(seq, hit)
            seq.blocks.ids = list(table)
            seq.blocks.num_registered = len(hit.block_ids)
        ids = seq.blocks.ids
        index = self._copy_target(ids, seq.num_computed_tokens, seq.num_kv_tokens)
        if index is not None:
            old = ids[index]
            new = self.pool.allocate()
            self.pending_copies.append((old, new))
            self.pool.release(old)
            ids[index] = new
        end = max(seq.num_computed_tokens + num_new_tokens, seq.num_kv_tokens)
        for _ in range(self.blocks_needed(end) - len(ids)):
            ids.append(self.pool.allocate())
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares all of ``parent``'s blocks; a write to a shared one copies it."""
        table = parent.blocks
        for block_id in table.ids:
            self.pool.acquire(block_id)
        child.blocks = BlockTable(
            list(table.ids), list(table.hashes[: len(table.ids)]), table.num_registered
        )

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks, tail first so the prefix is evicted last."""
        for block_id in reversed(seq.blocks.ids):
            self.pool.release(block_id)
        seq.blocks.ids = []
        seq.blocks.num_registered = 0
        seq.num_kv_tokens = 0
        seq.num_computed_tokens = 0

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past the sequence's KV (rejected draft tokens were written
        there); the block holding its last KV token stays, its free slots to be overwritten."""
        ids = seq.blocks.ids
        keep = self.blocks_needed(max(seq.num_kv_tokens, seq.num_computed_tokens))
        for block_id in reversed(ids[keep:]):
            self.pool.release(block_id)
        del ids[keep:]

    def register_computed(self, seq: Sequence) -> None:
        """Publish the hashes of blocks whose KV is now fully written."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_kv_tokens, seq.num_tokens) // self.block_size
        if num_full <= seq.blocks.num_registered:
            return
        hashes = self._full_block_hashes(seq)
        for i in range(seq.blocks.num_registered, num_full):
            parent = hashes[i - 1] if i else self._root(seq)
            self.pool.register(seq.blocks.ids[i], hashes[i], parent)
        seq.blocks.num_registered = num_full

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies
