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
    token_ids: list[int],
    scheme: HashScheme,
    max_blocks: int | None = None,
    adapter: tuple[str, str] | None = None,
) -> list[bytes]:
    """The hashes of the prompt's full blocks, first to last (at most ``max_blocks``), for
    the base model or a LoRA ``adapter`` (its (name, path) key, as the node's feed lists it:
    the node roots an adapter's blocks at it)."""
    if max_blocks is not None:
        token_ids = token_ids[: max_blocks * scheme.block_size]
    return chained_hashes(root_hash(scheme.seed, adapter), token_ids, scheme.block_size)


class PromptHashes:
    """One prompt's hashes per scheme (and adapter key), computed once however many nodes
    share them."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self._by_scheme: dict[tuple[HashScheme, tuple[str, str] | None], list[bytes]] = {}

    def for_scheme(self, scheme: HashScheme, adapter: tuple[str, str] | None = None) -> list[bytes]:
        hashes = self._by_scheme.get((scheme, adapter))
        if hashes is None:
            hashes = self._by_scheme[scheme, adapter] = block_hashes(
                self.token_ids, scheme, adapter=adapter
            )
        return hashes
