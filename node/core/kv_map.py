"""The block pool as an observer sees it: who holds each block, what is shared or cached, and
how many allocated slots hold no token.

``waste_slots`` feeds the ``pagedllm:kv_cache_waste_perc`` metric after every step, so it looks
only at the tail of each block table (a sequence's blocks before its last K/V-holding one are
full). ``take_map`` builds the whole map for ``GET /kv``; it costs a pass over the held and the
cached blocks and runs only while someone watches the page (see ``serve.kv_map_sender``).

A slot holds a token when the token's K/V is written or is being written by the step in flight
(``Sequence.num_kv_tokens``): blocks are allocated just before the step that fills them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.sequence import Sequence

# Bytes of a cached block's hash shown on the map (a prefix of the 16-byte digest).
SHOWN_HASH_BYTES = 8


def waste_slots(running: Iterable[Sequence], block_size: int) -> int:
    """Allocated slots holding no token, over the blocks the ``running`` sequences hold.

    A block shared by several sequences counts once, with the most tokens any of them has in
    it: sharing is by content, so they agree on what is written.
    """
    partial: dict[int, int] = {}  # block id -> tokens in it, for blocks not full
    for seq in running:
        ids = seq.blocks.ids
        kv = seq.num_kv_tokens
        for i in range(kv // block_size, len(ids)):
            filled = max(0, kv - i * block_size)
            block = ids[i]
            if filled > partial.get(block, -1):
                partial[block] = filled
    return sum(block_size - filled for filled in partial.values())


def waste_fraction(running: Iterable[Sequence], manager: BlockManager) -> float:
    """Share of allocated slots holding no token (0 with nothing allocated)."""
    used = manager.pool.num_used
    if used == 0:
        return 0.0
    return waste_slots(running, manager.block_size) / (used * manager.block_size)


@dataclass
class SeqBlocks:
    """One sequence's block table: ``num_tokens`` tokens with K/V, in ``block_ids`` order."""

    request_id: str
    index: int  # the sequence's index within its request (n > 1, beams)
    num_tokens: int
    block_ids: list[int]

    def __post_init__(self) -> None:
        if self.num_tokens < 0 or self.index < 0:
            raise ValueError(f"negative token count or index in {self.request_id!r}")


@dataclass
class MapTotals:
    running: int
    waiting: int
    waste_slots: int
    prefix_queries: int
    prefix_hits: int


@dataclass
class KVMap:
    """Every block's state: held (``seqs``' tables; ``shared_ids`` with ``shared_refs``
    references each), cached (free, its content reusable: ``cached_ids``, the first
    ``SHOWN_HASH_BYTES`` of each hash in ``cached_hashes``, prefix hits on it in
    ``cached_reuses``) or free."""

    num_blocks: int
    block_size: int
    num_used: int
    seqs: list[SeqBlocks]
    shared_ids: list[int]
    shared_refs: list[int]
    cached_ids: list[int]
    cached_hashes: bytes
    cached_reuses: list[int]
    totals: MapTotals

    def __post_init__(self) -> None:
        # Checked here so that a map that arrives over the wire is checked too.
        n = self.num_blocks
        if n < 1 or self.block_size < 1:
            raise ValueError(f"num_blocks {n}, block_size {self.block_size}")
        if len(self.shared_ids) != len(self.shared_refs):
            raise ValueError("shared_ids and shared_refs differ in length")
        cached = len(self.cached_ids)
        if len(self.cached_reuses) != cached or len(self.cached_hashes) != cached * (
            SHOWN_HASH_BYTES
        ):
            raise ValueError("cached_ids, cached_hashes and cached_reuses differ in length")
        for ids in (self.shared_ids, self.cached_ids, *(s.block_ids for s in self.seqs)):
            if ids and not 0 <= min(ids) <= max(ids) < n:
                raise ValueError(f"a block id outside [0, {n})")
        if any(r < 2 for r in self.shared_refs):
            raise ValueError("a shared block has fewer than two references")
        if not 0 <= self.num_used <= n:
            raise ValueError(f"num_used {self.num_used} outside [0, {n}]")


def take_map(
    manager: BlockManager, running: list[Sequence], num_running: int, num_waiting: int
) -> KVMap:
    """The map of ``manager``'s pool now (``running``: the sequences holding blocks)."""
    pool = manager.pool
    blocks = pool.blocks
    seqs = [
        SeqBlocks(s.request.request_id, s.index, s.num_kv_tokens, list(s.blocks.ids))
        for s in running
        if s.blocks.ids
    ]
    shared = sorted({b for s in seqs for b in s.block_ids if blocks[b].ref_count > 1})
    cached = pool.cached_free()
    return KVMap(
        num_blocks=pool.num_blocks,
        block_size=manager.block_size,
        num_used=pool.num_used,
        seqs=seqs,
        shared_ids=shared,
        shared_refs=[blocks[b].ref_count for b in shared],
        cached_ids=[b.block_id for b in cached],
        cached_hashes=b"".join(
            b.content_hash[:SHOWN_HASH_BYTES] for b in cached if b.content_hash is not None
        ),
        cached_reuses=[b.reuses for b in cached],
        totals=MapTotals(
            running=num_running,
            waiting=num_waiting,
            waste_slots=waste_slots(running, manager.block_size),
            prefix_queries=manager.prefix_queries,
            prefix_hits=manager.prefix_hits,
        ),
    )
