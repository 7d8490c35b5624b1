"""The UTF-8 guard of constrained outputs: its automaton agrees with Python's strict decoder on
every prefix, its packed masks are xgrammar's bit order, and a grammar's mask loses exactly the
tokens that would make the output's bytes malformed."""

from __future__ import annotations

import itertools
import random

import torch
import xgrammar as xgr

from pagedllm.structured.utf8 import BOUNDARY, Utf8Guard, after

# The edges of the continuation bytes' ranges: each valid ending can be made of them.
ENDINGS = (0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF)


def decodes_as_prefix(data: bytes) -> bool:
    """Whether some ending of at most three bytes makes ``data`` well-formed UTF-8, by Python's
    strict decoder (whose incremental mode lets some malformed prefixes wait, ED A0 among them)."""
    endings = [b""] + [bytes(e) for e in itertools.product(ENDINGS, repeat=3)]
    endings += [bytes(e) for e in itertools.product(ENDINGS, repeat=2)]
    endings += [bytes([e]) for e in ENDINGS]
    for ending in endings:
        try:
            (data + ending).decode("utf-8")
        except UnicodeDecodeError:
            continue
        return True
    return False


def test_the_automaton_agrees_with_pythons_decoder() -> None:
    rng = random.Random(0)
    samples = [bytes([a, b]) for a in range(256) for b in range(0x70, 0xC8, 3)]
    special = [0xC0, 0xC1, 0xE0, 0xED, 0xF0, 0xF4, 0xF5, 0xFF, 0x80, 0x9F, 0xA0, 0xBF, 0x8F, 0x90]
    samples += [
        bytes(rng.choice(special + [0x41, 0xC3, 0xE4]) for _ in range(5)) for _ in range(3000)
    ]
    samples += [s.encode() for s in ("a", "é", "中", "𝄞", "\U0010ffff", "\ud7ff")]
    for data in samples:
        assert (after(BOUNDARY, data) is not None) == decodes_as_prefix(data), data.hex()


def test_the_overlong_sequence_a_grammar_let_through_is_refused() -> None:
    # E0 9C 95: three bytes xgrammar took as one character, three U+FFFD to a decoder.
    assert after(BOUNDARY, b"\xe0") is not None
    assert after(BOUNDARY, b"\xe0\x9c") is None
    assert after(BOUNDARY, "ࠕ".encode()) == BOUNDARY  # U+0815 is E0 A0 95


def test_packed_masks_follow_xgrammars_bit_order() -> None:
    vocab = [b"a", b"\xe0", b"\x9c", b"\xa0", b"\xa0\x95", b"", b"\x95"] * 7  # 49 tokens
    guard = Utf8Guard(vocab, len(vocab) + 3)
    state = after(BOUNDARY, b"\xe0")
    assert state is not None
    allowed = guard.allowed(state)
    assert [bool(allowed[i]) for i in range(7)] == [False, False, False, True, True, True, False]
    assert bool(allowed[-1])  # beyond the tokenizer's vocabulary: no bytes
    logits = torch.zeros(1, len(vocab) + 3)
    xgr.apply_token_bitmask_inplace(logits, guard.packed(state)[None])
    assert torch.equal(logits[0] == 0, allowed)
