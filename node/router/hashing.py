"""A prompt's chained block hashes, computed exactly as a node's block manager computes them."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.block_manager import chained_hashes, root_hash


@dataclass(frozen=True)
class HashScheme:
    """What a node's hashes depend on besides the tokens (its feed's snapshot says both)."""

    block_size: int
    seed: int


def block_hashes(
    token_ids: list[int], scheme: HashScheme, max_blocks: int | None = None
) -> list[bytes]:
    """The hashes of the prompt's full blocks, first to last (at most ``max_blocks``)."""
    if max_blocks is not None:
        token_ids = token_ids[: max_blocks * scheme.block_size]
    return chained_hashes(root_hash(scheme.seed), token_ids, scheme.block_size)


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
