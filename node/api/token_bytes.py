"""The most bytes of prompt text one token can stand for, so that an over-long prompt is refused
before it is tokenized: text of more than ``max_model_len * L`` bytes has more than
``max_model_len`` tokens.

The bound holds only where every byte of the text ends up inside some token and nothing is
dropped or shrunk on the way: no normalizer that can shorten text (NFC, stripping, lowercasing),
no pre-tokenizer that removes what it splits on, no unknown token swallowing text, no added
token that absorbs the whitespace around it. For any other tokenizer there is no bound (None)
and the length is checked after tokenizing, as before.
"""

from __future__ import annotations

import json
from typing import Any

from tokenizers import decoders, pre_tokenizers

# Pre-tokenizers that keep every character of their input.
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split"})


def max_token_bytes(tokenizer: Any) -> int | None:
    """L: the longest token's byte length, or None when no such bound is sound."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    vocab: dict[str, int] = backend.get_vocab(with_added_tokens=True)
    byte_level = "ByteLevel" in _types(spec.get("pre_tokenizer"))
    if not (
        _keeps_length(spec.get("normalizer"))
        and _keeps_text(spec.get("pre_tokenizer"))
        and _covers_every_byte(spec.get("model") or {}, vocab, byte_level)
    ):
        return None
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    added_contents = {t["content"] for t in added}
    # A byte-level token's characters each stand for one byte: decoded, it has its true length.
    # Elsewhere a token's own text is at least as long as what it covers ("▁" for " ",
    # "<0x41>" for "A").
    decode = decoders.ByteLevel().decode if byte_level else None
    longest = 0
    for token in vocab:
        text = token if decode is None or token in added_contents else decode([token])
        longest = max(longest, len(text.encode("utf-8", "replace")))
    return longest or None


def _types(component: dict[str, Any] | None) -> list[str]:
    if component is None:
        return []
    if component.get("type") == "Sequence":
        parts = component.get("normalizers") or component.get("pretokenizers") or []
        return [t for part in parts for t in _types(part)]
    return [component.get("type", "")]


def _keeps_length(normalizer: dict[str, Any] | None) -> bool:
    """Whether the normalizer can only lengthen text: prepending, or replacing a string by one
    at least as long (SentencePiece's " " -> "▁")."""
    if normalizer is None:
        return True
    if normalizer.get("type") == "Sequence":
        return all(_keeps_length(n) for n in normalizer.get("normalizers") or [])
    if normalizer.get("type") == "Prepend":
        return True
    if normalizer.get("type") == "Replace":
        pattern = (normalizer.get("pattern") or {}).get("String")
        content = normalizer.get("content") or ""
        return bool(pattern) and len(content.encode()) >= len(pattern.encode())
    return False


def _keeps_text(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    if pre_tokenizer.get("type") == "Sequence":
        return all(_keeps_text(p) for p in pre_tokenizer.get("pretokenizers") or [])
    if pre_tokenizer.get("behavior") == "Removed":  # Split and Punctuation can drop
        return False
    return pre_tokenizer.get("type") in _KEEPING_PRE_TOKENIZERS


def _covers_every_byte(model: dict[str, Any], vocab: dict[str, int], byte_level: bool) -> bool:
    """Whether the BPE model has a token for every byte, so no text becomes an unknown token
    (or, with no unknown token, silently vanishes)."""
    if model.get("type") != "BPE":
        return False
    if byte_level:
        return all(c in vocab for c in pre_tokenizers.ByteLevel.alphabet())
    if model.get("byte_fallback"):
        return all(f"<0x{b:02X}>" in vocab for b in range(256))
    return False
