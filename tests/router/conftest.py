"""Fixtures of the router's tests."""

from __future__ import annotations

import pytest

from pagedllm.api.token_bytes import max_token_bytes
from pagedllm.api.tokenizing import TokenizingContext
from pagedllm.config import resolve_model_dir
from pagedllm.models.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def demo_dir() -> str:
    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def tokenizing(demo_dir: str) -> TokenizingContext:
    """The demo model's tokenizer as both the node and the router hold it."""
    tokenizer = load_tokenizer(demo_dir)
    return TokenizingContext(
        tokenizer=tokenizer,
        model_names=["pagedllm-demo"],
        model_dir=demo_dir,
        max_model_len=2048,
        vocab_size=len(tokenizer),
        max_token_bytes=max_token_bytes(tokenizer),
    )
