"""Fixtures of the router's tests."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from pagedllm.api.token_bytes import max_token_bytes
from pagedllm.api.tokenizing import TokenizingContext
from pagedllm.config import resolve_model_dir
from pagedllm.models.tokenizer import load_tokenizer
from pagedllm_testing.lora_adapters import demo_adapter
from pagedllm_testing.router_harness import start_router
from pagedllm_testing.serve_harness import Server, start_server


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


# A node speculating with this many draft tokens (so that the per-position acceptance counter
# has its positions too) and a router in front of it: what the two export is checked by the
# Grafana dashboard's test and the metrics reference's, which share them.
NUM_SPECULATIVE_TOKENS = 3


@pytest.fixture(scope="package")
def num_speculative_tokens() -> int:
    return NUM_SPECULATIVE_TOKENS


@pytest.fixture(scope="package")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = json.dumps({"method": "ngram", "num_speculative_tokens": NUM_SPECULATIVE_TOKENS})
    # Speculating and serving a LoRA adapter, so that it exports every metric family.
    adapter = demo_adapter(tmp_path_factory.mktemp("adapter") / "sql")
    server = start_server(
        tmp_path_factory.mktemp("speculating-node"),
        "--speculative-config",
        config,
        "--enable-lora",
        "--lora-modules",
        f"sql={adapter}",
    )
    yield server
    server.stop()


@pytest.fixture(scope="package")
def router(tmp_path_factory: pytest.TempPathFactory, node: Server) -> Iterator[Server]:
    server = start_router(tmp_path_factory.mktemp("router"), resolve_model_dir(None), [node.url])
    yield server
    server.stop()
