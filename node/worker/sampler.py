"""Turning logits into tokens: penalties, min_tokens, grammars, temperature, top-k/p, min-p,
beams.

Seeded rows draw from a generator seeded by (seed, output position), so a seeded request
gives the same tokens whatever else is in the batch and after a preemption.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedllm.core.step_plan import SamplingSpec
from pagedllm.sampling_params import derive_seed, mix_seed

if TYPE_CHECKING:
    from pagedllm.structured.matchers import TokenMask

# Temperatures below this are greedy: dividing by them overflows float32 logits.
SAMPLING_EPS = 1e-5


def _generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(mix_seed(seed, position + 1))
    return g


@dataclass
class SampleRow:
    spec: SamplingSpec
    prompt_ids: list[int]
    output_ids: list[int]
    num_samples: int = 1


@dataclass
class Sampled:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        s = row.spec
        if s.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), dtype=torch.long)
            seen = seen[seen < vocab]
            vals = logits[i, seen]
            logits[i, seen] = torch.where(
                vals > 0, vals / s.repetition_penalty, vals * s.repetition_penalty
            )
        if (s.frequency_penalty or s.presence_penalty) and row.output_ids:
            counts = torch.bincount(
                torch.tensor(row.output_ids, dtype=torch.long), minlength=vocab
            )[:vocab].to(logits.dtype)
            logits[i] -= s.frequency_penalty * counts + s.presence_penalty * (counts > 0)
        if len(row.output_ids) < s.min_tokens and s.min_tokens_blocked:
            blocked = torch.tensor(s.min_tokens_blocked, dtype=torch.long)
            logits[i, blocked[blocked < vocab]] = float("-inf")


def _token_rules(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """logit_bias, allowed_token_ids and bad words, row by row."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        s = row.spec
        if s.logit_bias:
            ids = torch.tensor(list(s.logit_bias), dtype=torch.long)
            bias = torch.tensor(list(s.logit_bias.values()), dtype=logits.dtype)
            keep = ids < vocab
            logits[i, ids[keep]] += bias[keep].to(logits.device)
        if s.allowed_token_ids is not None:
            allowed = torch.tensor(s.allowed_token_ids, dtype=torch.long)
            allowed = allowed[allowed < vocab].to(logits.device)
            kept = logits[i, allowed].clone()
            logits[i] = float("-inf")
            logits[i, allowed] = kept
        for word in s.bad_words_ids:
            prefix = word[:-1]
            if not prefix or row.output_ids[-len(prefix) :] == prefix:
                if word[-1] < vocab:
                    logits[i, word[-1]] = float("-inf")


def _has_token_rules(row: SampleRow) -> bool:
    s = row.spec
    return bool(s.logit_bias or s.allowed_token_ids is not None or s.bad_words_ids)


def filtered_probs(logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
    """Probabilities of each row of ``logits`` ([len(specs), vocab], float32) after its own
    temperature, top-k, top-p and min-p, the batch at once."""
    vocab = logits.shape[-1]
    rows = range(len(specs))
    if any(s.temperature != 1.0 for s in specs):
        temperatures = torch.tensor([s.temperature for s in specs], dtype=logits.dtype)
        logits = logits / temperatures.to(logits.device)[:, None]
    top_ks = [s.top_k if 0 < s.top_k < vocab else 0 for s in specs]
    if any(top_ks):
        # Each row keeps the logits at least its k-th largest (ties included).
        values = torch.topk(logits, max(top_ks), dim=-1).values
        kth = torch.full((len(specs), 1), float("-inf"), device=logits.device)
        for i in rows:
            if top_ks[i]:
                kth[i, 0] = values[i, top_ks[i] - 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    cut = False
    for i in rows:
        if specs[i].top_p < 1.0:
            _top_p(probs[i], specs[i].top_p)
            cut = True
    if any(s.min_p > 0.0 for s in specs):
        min_ps = torch.tensor([s.min_p for s in specs], dtype=probs.dtype, device=probs.device)
        floor = min_ps[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
        cut = True
    return probs / probs.sum(dim=-1, keepdim=True) if cut else probs


def _top_p(probs: torch.Tensor, top_p: float) -> None:
    """Zero, in place, what falls outside the smallest set of most likely tokens whose mass
    reaches ``top_p`` (the most likely token always stays)."""
    # Tokens below (1 - top_p) / vocab hold less than 1 - top_p together, so those above it
    # reach top_p before any of them: only those are sorted (halved against rounding). A
    # sort of the whole row is some 20 times slower than the compare at SmolLM2's 49,152.
    floor = (1.0 - top_p) / (2 * probs.shape[-1])
    candidates = torch.nonzero(probs >= floor)[:, 0]
    top, order = torch.sort(probs[candidates], descending=True)
    # A token goes when the more likely ones before it already reach top_p; the first stays
    # whatever top_p (one too small for float32 compares as 0).
    keep = (torch.cumsum(top, dim=-1) - top) < top_p
    keep[0] = True
    kept = candidates[order[keep]]
    values = probs[kept]
    probs.zero_()
    probs[kept] = values


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> list[int]:
    """One token per row of ``probs`` ([n, vocab]) by inverse transform sampling: the first
    token whose cumulative probability exceeds ``uniforms[i]`` (in [0, 1)) times the row's
    mass. One random number a row, where a race of exponentials needs one per token."""
    cdf = torch.cumsum(probs, dim=-1)
    targets = uniforms.to(cdf.dtype)[:, None] * cdf[:, -1:]
    picked = torch.searchsorted(cdf, targets, right=True).clamp_(max=probs.shape[-1] - 1)
    tokens = picked[:, 0].tolist()
    # A target rounded up to the row's whole mass: its last token that can occur.
    for i in torch.nonzero(probs.gather(1, picked)[:, 0] <= 0.0)[:, 0].tolist():
        tokens[i] = int(torch.nonzero(probs[i]).max())
    return tokens


def uniform(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """One number in [0, 1) from ``generator`` (a seeded row's) or the global generator."""
    return torch.rand(1, generator=generator, device=device)


def _sample_rows(processed: torch.Tensor, rows: list[SampleRow]) -> dict[int, list[int]]:
    """The tokens of the rows that sample at random (not greedy, not beams), by row index:
    their probabilities filtered as a batch, then one uniform number per sample, the
    unseeded ones drawn together."""
    picked = [
        i
        for i, row in enumerate(rows)
        if row.spec.beam_width == 0 and row.spec.temperature >= SAMPLING_EPS
    ]
    if not picked:
        return {}
    every_row = len(picked) == len(rows)
    probs = filtered_probs(
        processed if every_row else processed[picked], [rows[i].spec for i in picked]
    )
    owners: list[int] = []
    seeded: dict[int, torch.Tensor] = {}  # position in owners -> its uniform
    for j, i in enumerate(picked):
        row = rows[i]
        for k in range(row.num_samples):
            seed = derive_seed(row.spec.seed, k)
            if seed is not None:
                gen = _generator(seed, len(row.output_ids), processed.device)
                seeded[len(owners)] = uniform(gen, processed.device)
            owners.append(j)
    uniforms = torch.rand(len(owners), device=processed.device)
    for at, u in seeded.items():
        uniforms[at] = u[0]
    fanned = len(owners) > len(picked)
    tokens = draw(probs[torch.tensor(owners, device=probs.device)] if fanned else probs, uniforms)
    drawn: dict[int, list[int]] = {}
    for j, token in zip(owners, tokens, strict=True):
        drawn.setdefault(picked[j], []).append(token)
    return drawn


def processed_logits(
    logits: torch.Tensor, rows: list[SampleRow], mask: TokenMask | None = None
) -> torch.Tensor:
    """``logits`` (float32) after each row's penalties, min_tokens, token rules and grammar;
    a copy when any of them applies."""
    token_rules = any(_has_token_rules(r) for r in rows)
    needs_processing = (
        mask is not None
        or token_rules
        or any(
            r.spec.repetition_penalty != 1.0
            or r.spec.frequency_penalty
            or r.spec.presence_penalty
            or len(r.output_ids) < r.spec.min_tokens
            for r in rows
        )
    )
    processed = logits.clone() if needs_processing else logits
    if needs_processing:
        _apply_penalties(processed, rows)
    if token_rules:
        _token_rules(processed, rows)
    if mask is not None:
        mask.apply(processed)
    return processed


def sample(
    logits: torch.Tensor, rows: list[SampleRow], mask: TokenMask | None = None
) -> list[Sampled]:
    """Sample each row of ``logits`` ([len(rows), vocab], float32) by its spec; ``mask``
    holds the tokens the constrained rows' grammars allow. Log probabilities are those of the
    model, before penalties and grammars."""
    logits = logits.float()
    # One log-softmax of the batch for the chosen tokens' and the top log probabilities: on
    # the CPU torch's logsumexp alone took 15 times as long (485 against 32 us at one row of
    # SmolLM2's 49,152 tokens), and max's indices 3 times less than argmax (the same first
    # index of a tie).
    logprobs = torch.log_softmax(logits, dim=-1)
    processed = processed_logits(logits, rows, mask)
    drawn = _sample_rows(processed, rows)
    greedy_tokens = torch.max(processed, dim=-1).indices.tolist() if len(drawn) < len(rows) else []
    results: list[Sampled] = []
    for i, row in enumerate(rows):
        spec = row.spec
        if spec.beam_width > 0:
            beam_logprobs = torch.log_softmax(processed[i], dim=-1)
            top = torch.topk(beam_logprobs, min(2 * spec.beam_width, beam_logprobs.shape[-1]))
            tokens = top.indices.tolist()
            results.append(Sampled(tokens, top.values.tolist(), None))
            continue
        tokens = drawn[i] if i in drawn else [greedy_tokens[i]] * row.num_samples
        token_logprobs = logprobs[i, tokens].tolist()
        top_lists = None
        if spec.logprobs:
            top = torch.topk(logprobs[i], spec.logprobs)
            pairs = list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
            top_lists = [pairs] * len(tokens)
        results.append(Sampled(tokens, token_logprobs, top_lists))
    return results
