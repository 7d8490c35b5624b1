"""The sampler: each row's probabilities after temperature, top-k, top-p and min-p equal their
definition (a sort of the whole row), draws follow them, and a seeded row gets the same token
alone or in any batch."""

from __future__ import annotations

import pytest
import torch

from pagedllm.core.step_plan import SamplingSpec
from pagedllm.worker.sampler import SampleRow, draw, filtered_probs, sample

SPECS = [
    SamplingSpec(),
    SamplingSpec(temperature=0.5),
    SamplingSpec(temperature=1.3, top_k=7),
    SamplingSpec(top_p=0.6),
    SamplingSpec(temperature=0.8, top_p=0.95, top_k=40),
    SamplingSpec(min_p=0.05),
    SamplingSpec(temperature=2.0, top_p=0.3, min_p=0.2),
    SamplingSpec(top_p=1e-46),  # 0 in float32: the most likely token only
]


def reference_probs(logits: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """One row by the definitions, sorting the whole row."""
    logits = logits / spec.temperature
    if 0 < spec.top_k < logits.shape[-1]:
        kth = torch.sort(logits, descending=True).values[spec.top_k - 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if spec.top_p < 1.0:
        ordered, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(ordered, dim=-1) - ordered < spec.top_p
        keep[0] = True  # the most likely token, whatever top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, ordered * keep)
    if spec.min_p > 0.0:
        probs = probs.masked_fill(probs < spec.min_p * probs.max(), 0.0)
    return probs / probs.sum()


@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0])  # from flat rows to peaked ones
def test_filtered_probabilities_equal_their_definition(scale: float) -> None:
    torch.manual_seed(1)
    logits = torch.randn(len(SPECS), 5000) * scale
    probs = filtered_probs(logits, SPECS)
    for i, spec in enumerate(SPECS):
        expected = reference_probs(logits[i], spec)
        assert torch.equal(probs[i] > 0, expected > 0), spec
        assert torch.allclose(probs[i], expected, atol=1e-6), spec


def test_draws_follow_the_filtered_probabilities() -> None:
    torch.manual_seed(2)
    logits = torch.randn(12) * 1.5
    draws = 20000
    for spec in SPECS:
        rows = [SampleRow(spec, [0], []) for _ in range(draws)]
        tokens = [s.token_ids[0] for s in sample(logits.expand(draws, -1), rows)]
        seen = torch.bincount(torch.tensor(tokens), minlength=12) / draws
        expected = reference_probs(logits, spec)
        # Five standard deviations of a frequency over 20,000 draws at most, and never a token
        # the filters removed.
        assert torch.all(seen[expected == 0] == 0), spec
        assert torch.allclose(seen, expected, atol=5 * (0.25 / draws) ** 0.5), spec


def test_a_uniform_at_the_top_of_its_range_lands_on_a_possible_token() -> None:
    probs = torch.tensor([[0.25, 0.0, 0.75, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    top = torch.tensor([torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item()] * 2)
    assert draw(probs, top) == [2, 0]
    assert draw(probs, torch.zeros(2)) == [0, 0]


def test_a_seeded_row_draws_the_same_token_alone_and_in_any_batch() -> None:
    torch.manual_seed(3)
    logits = torch.randn(6, 300)
    seeded = SampleRow(SamplingSpec(temperature=0.9, top_p=0.9, seed=11), [1, 2], [3])
    alone = sample(logits[2:3], [seeded])[0].token_ids
    for position in range(6):
        others = [SampleRow(s, [1], []) for s in SPECS[:5]]
        rows = others[:position] + [seeded] + others[position:]
        batch = torch.cat([logits[:position], logits[2:3], logits[position + 1 :]])
        assert sample(batch, rows)[position].token_ids == alone
    # The position in the output changes the draw: a seed gives one stream, not one token.
    later = SampleRow(seeded.spec, [1, 2], [3, 4, 5])
    draws = {tuple(sample(logits[2:3], [later])[0].token_ids) for _ in range(3)}
    assert len(draws) == 1


def test_a_fanned_out_row_draws_each_sample_on_its_own() -> None:
    torch.manual_seed(4)
    logits = torch.zeros(1, 1000)  # every token equally likely
    out = sample(logits, [SampleRow(SamplingSpec(), [0], [], num_samples=8)])[0]
    assert len(out.token_ids) == 8
    assert len(set(out.token_ids)) > 1
    greedy = sample(logits, [SampleRow(SamplingSpec(temperature=0.0), [0], [], 3)])[0]
    assert greedy.token_ids == [0, 0, 0]
