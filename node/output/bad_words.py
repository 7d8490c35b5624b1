"""``bad_words`` as token sequences, tokenized as vLLM does: each word alone and after a
space (a word inside text usually starts with one), without special tokens."""

from __future__ import annotations

from typing import Any


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    out: list[list[int]] = []
    for word in words:
        for form in (word.strip(), " " + word.strip()):
            ids = list(tokenizer.encode(form, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return out
