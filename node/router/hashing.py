"""A prompt's chained block hashes, computed exactly as a node's block manager computes them."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.block_manager import block_hash, root_hash


@dataclass(frozen=True)
class HashScheme:
    """What a node's hashes depend on besides the tokens (its feed's snapshot says both)."""

    block_size: int
    seed: int


def block_hashes(
    token_ids: list[int], scheme: HashScheme, max_blocks: int | None = None
) -> list[bytes]:
    """The hashes of the prompt's full blocks, first to last (at most ``max_blocks``)."""
    bs = scheme.block_size
    count = len(token_ids) // bs
    if max_blocks is not None:
        count = min(count, max_blocks)
    hashes: list[bytes] = []
    parent = root_hash(scheme.seed)
    for i in range(count):
        parent = block_hash(parent, token_ids[i * bs : (i + 1) * bs])
        hashes.append(parent)
    return hashes


class PromptHashes:
    """One prompt's hashes per scheme, computed once however many nodes share a scheme."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self._by_scheme: dict[HashScheme, list[bytes]] = {}

    def for_scheme(self, scheme: HashScheme) -> list[bytes]:
        hashes = self._by_scheme.get(scheme)
        if hashes is None:
            hashes = self._by_scheme[scheme] = block_hashes(self.token_ids, scheme)
        return hashes
