"""Verifying draft tokens: the longest prefix the model agrees with, plus one token of its own.

The model's logits at each draft position and one past the last are scored as the sampler
would score a one-token step there: each position's penalties and token rules see the drafts
before it as outputs. Greedy rows accept a draft while it is the argmax. Sampled rows use
rejection sampling for a one-hot draft (vLLM's): draft ``x`` is accepted with probability
``p(x)``; on rejection the token is drawn from ``p`` with ``x`` removed and renormalised, which
leaves every position distributed exactly as ``p``; when all drafts pass, the last position
gives a bonus token. Seeded rows draw from a generator seeded by (seed, output position), like
the sampler.
"""

from __future__ import annotations

import torch

from pagedllm.core.step_plan import SamplingSpec
from pagedllm.worker.sampler import (
    SAMPLING_EPS,
    Sampled,
    SampleRow,
    _generator,
    draw,
    filtered_probs,
    processed_logits,
    uniform,
)


def verify(
    logits: torch.Tensor,
    spec: SamplingSpec,
    prompt_ids: list[int],
    output_ids: list[int],
    draft: list[int],
) -> Sampled:
    """The tokens ``logits`` ([len(draft) + 1, vocab]: the rows after the last known token and
    after each draft token) make of ``draft``: the accepted drafts, then one more."""
    logits = logits.float()
    rows = [SampleRow(spec, prompt_ids, output_ids + draft[:i]) for i in range(len(draft) + 1)]
    processed = processed_logits(logits, rows)
    tokens: list[int] = []
    if spec.temperature < SAMPLING_EPS:
        target = torch.max(processed, dim=-1).indices.tolist()  # as the sampler picks
        for want, got in zip(draft, target, strict=False):
            tokens.append(got)
            if got != want:
                break
        else:
            tokens.append(target[len(draft)])
    else:
        tokens = _rejection_sample(processed, spec, len(output_ids), draft)
    raw_logprobs = torch.log_softmax(logits[: len(tokens)], dim=-1)
    chosen = torch.tensor(tokens, device=logits.device)[:, None]
    return Sampled(tokens, raw_logprobs.gather(1, chosen)[:, 0].tolist(), None)


def _rejection_sample(
    processed: torch.Tensor, spec: SamplingSpec, num_outputs: int, draft: list[int]
) -> list[int]:
    tokens: list[int] = []
    probs = filtered_probs(processed[: len(draft) + 1], [spec] * (len(draft) + 1))
    device = processed.device
    for i in range(len(draft) + 1):
        gen = None if spec.seed is None else _generator(spec.seed, num_outputs + i, device)
        if i == len(draft):
            tokens.extend(draw(probs[i : i + 1], uniform(gen, device)))
            break
        x = draft[i]
        u = torch.rand((), generator=gen, device=device)
        if u < probs[i, x]:
            tokens.append(x)
            continue
        residual = probs[i : i + 1].clone()
        residual[0, x] = 0.0
        tokens.extend(draw(residual, uniform(gen, device)))
        break
    return tokens
