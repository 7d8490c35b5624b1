"""Fixtures shared by the node's tests."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from pagedllm.serve.worker_process import torch_threads


@pytest.fixture(scope="session")
def offline() -> LLM:
    """The offline API on the demo model, the reference the server's answers are held to.

    It computes with as many threads as a node's worker, so that both take the same numerical
    path, and leaves the other cores to the servers under test. Tests give it prompts no other
    test uses, so that a prefix-cache hit never changes its path either."""
    torch.set_num_threads(torch_threads(1))
    return LLM(kv_cache_memory=32 << 20)
