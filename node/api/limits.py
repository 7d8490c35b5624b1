"""How much work one HTTP request may ask of the node (``--max-prompts-per-request``,
``--max-n``, ``--max-request-tokens``), so that no single request holds it for minutes."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.api.protocol import MAX_SAMPLES

# OpenAI's own limit for n: the request bodies accept no more, whatever --max-n says.
MAX_N_LIMIT = MAX_SAMPLES


@dataclass(frozen=True)
class RequestLimits:
    max_prompts_per_request: int = 256
    max_n: int = 64
    # Sequences (best_of or n, times prompts) times the tokens each may generate.
    max_request_tokens: int = 2**20


def prompts_refusal(limits: RequestLimits, prompts: int) -> str | None:
    if prompts > limits.max_prompts_per_request:
        return (
            f"this request asks for {prompts} prompts; --max-prompts-per-request is "
            f"{limits.max_prompts_per_request}"
        )
    return None


def samples_refusal(limits: RequestLimits, n: int, best_of: int | None) -> tuple[str, str] | None:
    """The message and the field, when ``n`` or ``best_of`` asks for too many sequences."""
    for name, value in (("n", n), ("best_of", best_of)):
        if value is not None and value > limits.max_n:
            return f"this request asks for {name}={value}; --max-n is {limits.max_n}", name
    return None


def tokens_refusal(limits: RequestLimits, sequences: int, budget: list[int]) -> str | None:
    """``budget``: the tokens each prompt's sequences may generate; ``sequences`` per prompt."""
    total = sequences * sum(budget)
    if total > limits.max_request_tokens:
        return (
            f"this request may generate up to {total} tokens ({sequences} sequences per prompt, "
            f"{len(budget)} prompts, up to {max(budget)} tokens each); --max-request-tokens is "
            f"{limits.max_request_tokens}: lower n, best_of, max_tokens or the number of prompts"
        )
    return None
