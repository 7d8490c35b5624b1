"""Which blocks one node can reuse, as its KV-events feed says, and how much of a prompt that
covers."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedllm.router.hashing import HashScheme


@dataclass
class Residency:
    """The hashes in one node's prefix cache (its hash map), kept from its feed."""

    scheme: HashScheme
    hashes: set[bytes] = field(default_factory=set)

    def apply(self, removed: Iterable[bytes], stored: Iterable[bytes]) -> None:
        """An update, in the feed's order: removals first, then what was stored."""
        self.hashes.difference_update(removed)
        self.hashes.update(stored)

    def cached_blocks(self, prompt_hashes: list[bytes]) -> int:
        """How many leading blocks of the prompt the node holds: its prefix cache hit, as the
        node's block manager looks it up (block by block, stopping at the first miss)."""
        count = 0
        for h in prompt_hashes:
            if h not in self.hashes:
                break
            count += 1
        return count

    def cached_tokens(self, prompt_hashes: list[bytes]) -> int:
        return self.cached_blocks(prompt_hashes) * self.scheme.block_size
