"""How close a quantized model's outputs stay to the float32 path's, on the real model: greedy
tokens over chat prompts, teacher-forced argmax agreement, and perplexity on a fixed text.

The logits are computed as the engine computes decode steps, a few tokens a step (``CHUNK``),
so that the quantized matmuls run their decode path (int8 rows with VNNI) rather than the float
GEMM that long prefills take.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedllm.models.llama import CausalLM
from pagedllm_testing.paged_logits import PagedRun, PagedSequence

CHUNK = 16
# The chat questions both the quality test and bench/quantized.py ask (12).
CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish and German.",
    "Name the planets of the solar system in order.",
    "What does a compiler do?",
    "Suggest a name for a small bakery.",
    "Why is the sky blue?",
    "List three uses of a paperclip.",
    "How do I boil an egg?",
]
TEXT = Path(__file__).with_name("data") / "perplexity.txt"
TEXT_TOKENS = 2000


def activations_dtype(model: CausalLM) -> torch.dtype:
    """The dtype the engine keeps a model's KV cache in by default (its norms')."""
    return model.model.norm.weight.dtype


def chunked_logits(
    model: CausalLM, ids: list[int], chunk: int = CHUNK, cache_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``[len(ids), vocab]`` logits of one sequence fed ``chunk`` tokens a step, its KV cache
    in ``cache_dtype`` (default: the activations')."""
    run = PagedRun(
        model,
        16,
        num_blocks=len(ids) // 16 + 1,
        cache_dtype=cache_dtype or activations_dtype(model),
    )
    sequence = PagedSequence(torch.tensor(ids))
    outputs = []
    for start in range(0, len(ids), chunk):
        step = run.step([sequence], {0: min(chunk, len(ids) - start)})
        outputs.append(step[0])
    return torch.cat(outputs)


def perplexity(
    model: CausalLM, ids: list[int], chunk: int = CHUNK, cache_dtype: torch.dtype | None = None
) -> float:
    logits = chunked_logits(model, ids, chunk, cache_dtype)[:-1].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))
    return math.exp(nll.item())


@dataclass
class Agreement:
    agreeing: int  # teacher-forced positions whose argmax agrees
    positions: int

    @property
    def fraction(self) -> float:
        return self.agreeing / self.positions


def teacher_forced_agreement(
    model: CausalLM,
    prompt: list[int],
    reference_tokens: list[int],
    cache_dtype: torch.dtype | None = None,
) -> Agreement:
    """Over ``reference_tokens`` (another model's greedy continuation of ``prompt``), how often
    ``model``'s argmax given the reference's prefix is the reference's next token."""
    logits = chunked_logits(model, prompt + reference_tokens, cache_dtype=cache_dtype)
    predicted = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    agreeing = sum(p == t for p, t in zip(predicted, reference_tokens, strict=True))
    return Agreement(agreeing, len(reference_tokens))


def first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    """The first position where two greedy continuations differ; None if they never do."""
    for position, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return position
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def greedy_tokens(
    model: CausalLM, prompt: list[int], count: int, cache_dtype: torch.dtype | None = None
) -> list[int]:
    """``count`` greedy tokens after ``prompt``: the prompt fed ``CHUNK`` tokens a step, then
    one token a step, as the engine decodes."""
    run = PagedRun(
        model,
        16,
        num_blocks=(len(prompt) + count) // 16 + 1,
        cache_dtype=cache_dtype or activations_dtype(model),
    )
    sequence = PagedSequence(torch.tensor(prompt + [0] * count))
    logits = None
    for start in range(0, len(prompt), CHUNK):
        logits = run.step([sequence], {0: min(CHUNK, len(prompt) - start)})[0]
    tokens: list[int] = []
    while True:
        assert logits is not None
        token = int(logits[-1].argmax())
        tokens.append(token)
        if len(tokens) == count:
            return tokens
        sequence.tokens[len(prompt) + len(tokens) - 1] = token
        logits = run.step([sequence], {0: 1})[0]
