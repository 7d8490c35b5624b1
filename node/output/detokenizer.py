"""Incremental detokenization and stop strings for one output sequence."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StopHit:
    stop: str
    # Text kept: up to the stop string, or through it with include_stop_str_in_output.
    keep: int


def find_stop(text: str, new_from: int, stops: list[str], include: bool) -> StopHit | None:
    """The earliest stop string that ends in ``text[new_from:]`` (it may start before)."""
    best: StopHit | None = None
    best_at = len(text)
    for stop in stops:
        at = text.find(stop, max(0, new_from - len(stop) + 1))
        if 0 <= at < best_at:
            best_at = at
            best = StopHit(stop, at + len(stop) if include else at)
    return best


@dataclass
class IncrementalDetokenizer:
    """Decodes tokens as they arrive without re-decoding the whole output each time.

    Text is only emitted once it no longer ends in an incomplete UTF-8 sequence; the
    window ``prefix_offset:read_offset`` gives the tokenizer enough context for spacing.
    """

    tokenizer: Any
    skip_special_tokens: bool = True
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; return the text they complete."""
        self.token_ids.extend(new_ids)
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            self.text += delta
            return delta
        return ""
