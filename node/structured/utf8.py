"""Well-formed UTF-8 for constrained outputs.

xgrammar matches characters byte by byte and takes any continuation byte after a lead byte, so
a grammar lets through sequences that no decoder reads as one character: E0 9C 95 (an
overlong encoding) passes a JSON string of at most one character, and decodes as three
U+FFFD, which the schema then refuses. The guard keeps a constrained output's bytes a prefix
of well-formed UTF-8 (RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF): in
each state of the automaton below, the tokens whose bytes would break it are masked, one
packed mask per state, built once.
"""

from __future__ import annotations

from functools import cache

import torch

# A state: (continuation bytes still due, the lowest and highest the next one may be).
Utf8State = tuple[int, int, int]
BOUNDARY: Utf8State = (0, 0, 0)
_CONTINUATION = (0x80, 0xBF)


def _lead(byte: int) -> Utf8State | None:
    """The state after ``byte`` at a character boundary, or None if no character starts so."""
    if byte < 0x80:
        return BOUNDARY
    if 0xC2 <= byte <= 0xDF:
        return (1, *_CONTINUATION)
    if byte == 0xE0:
        return (2, 0xA0, 0xBF)  # below A0: an overlong encoding
    if byte == 0xED:
        return (2, 0x80, 0x9F)  # above 9F: a UTF-16 surrogate
    if 0xE1 <= byte <= 0xEF:
        return (2, *_CONTINUATION)
    if byte == 0xF0:
        return (3, 0x90, 0xBF)
    if 0xF1 <= byte <= 0xF3:
        return (3, *_CONTINUATION)
    if byte == 0xF4:
        return (3, 0x80, 0x8F)  # above 8F: beyond U+10FFFF
    return None  # a continuation byte, C0, C1 or F5-FF


def after(state: Utf8State | None, data: bytes) -> Utf8State | None:
    """The state after ``data`` from ``state``, or None once the bytes are not well formed."""
    for byte in data:
        if state is None:
            return None
        due, low, high = state
        if due == 0:
            state = _lead(byte)
        elif low <= byte <= high:
            state = (due - 1, *_CONTINUATION) if due > 1 else BOUNDARY
        else:
            return None
    return state


class Utf8Guard:
    """The tokens of a vocabulary (their bytes, ``token_bytes[i]`` for token ``i``) that keep
    an output well formed, in each state, packed as xgrammar's bitmask rows are (bit ``i % 32``
    of word ``i // 32``)."""

    def __init__(self, token_bytes: list[bytes], vocab_size: int) -> None:
        self.token_bytes = token_bytes
        self.vocab_size = vocab_size
        self.packed = cache(self._packed)

    def allowed(self, state: Utf8State) -> torch.Tensor:
        """Bool ``[vocab_size]``: the tokens after which the output is still well formed
        (a token of no bytes, or beyond the tokenizer's vocabulary, changes nothing)."""
        keep = [
            i >= len(self.token_bytes) or after(state, self.token_bytes[i]) is not None
            for i in range(self.vocab_size)
        ]
        return torch.tensor(keep, dtype=torch.bool)

    def _packed(self, state: Utf8State) -> torch.Tensor:
        keep = self.allowed(state)
        words = -(-self.vocab_size // 32)
        bits = torch.zeros(words * 32, dtype=torch.int64)
        bits[: self.vocab_size] = keep.long()
        packed = (bits.view(words, 32) << torch.arange(32)).sum(dim=1)
        # Words as int32, as xgrammar's bitmask holds them (bit 31 set: negative).
        return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
