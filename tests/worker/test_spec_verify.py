"""Draft verification: greedy rows accept exactly the argmax prefix; sampled rows keep the
model's distribution (rejection sampling for a one-hot draft), whatever the draft."""

from __future__ import annotations

import pytest
import torch

from pagedllm.core.step_plan import SamplingSpec
from pagedllm.worker.spec_verify import verify

LOGITS = torch.tensor(
    [[2.0, 1.0, 0.5, -1.0], [0.0, 1.5, 1.0, 0.2], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float32
)


def test_greedy_accepts_the_argmax_prefix_and_adds_the_next_argmax() -> None:
    greedy = SamplingSpec(temperature=0.0)
    assert verify(LOGITS, greedy, [3], [], [0, 1]).token_ids == [0, 1, 0]
    assert verify(LOGITS, greedy, [3], [], [0, 2]).token_ids == [0, 1]
    assert verify(LOGITS, greedy, [3], [], [2, 1]).token_ids == [0]
    out = verify(LOGITS, greedy, [3], [], [0, 1])
    expected = torch.log_softmax(LOGITS, -1)[[0, 1, 2], [0, 1, 0]].tolist()
    assert out.logprobs == pytest.approx(expected)


def test_penalties_see_the_drafts_before_each_position() -> None:
    # With a strong repetition penalty, token 1 drafted at position 0 is penalised at
    # position 1, where it would otherwise be the argmax.
    spec = SamplingSpec(temperature=0.0, repetition_penalty=100.0)
    logits = torch.tensor([[0.0, 3.0, 0.0, 0.0], [0.0, 3.0, 2.0, 0.0], [0.0] * 4])
    assert verify(logits, spec, [0], [], [1, 1]).token_ids == [1, 2]


@pytest.mark.parametrize("draft", [[0, 1], [3, 3], [2, 0]])
def test_sampled_tokens_keep_the_model_distribution(draft: list[int]) -> None:
    spec = SamplingSpec(temperature=0.8)
    torch.manual_seed(0)
    probs = torch.softmax(LOGITS / 0.8, -1)
    draws = 6000
    first = torch.zeros(4)
    second_after = {t: torch.zeros(4) for t in range(4)}
    for _ in range(draws):
        tokens = verify(LOGITS, spec, [3], [], draft).token_ids
        assert 1 <= len(tokens) <= len(draft) + 1
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second_after[tokens[0]][tokens[1]] += 1
    # The first token is distributed as the model's first row, whatever the draft was
    # (a tolerance of about five standard deviations of a frequency over 6000 draws).
    assert torch.allclose(first / draws, probs[0], atol=0.035)
    # After an accepted first draft, the second token follows the model's second row.
    seen = second_after[draft[0]]
    if seen.sum() > 1000:
        assert torch.allclose(seen / seen.sum(), probs[1], atol=0.07)


def test_seeded_rows_repeat_their_tokens() -> None:
    spec = SamplingSpec(temperature=1.0, seed=7)
    runs = {tuple(verify(LOGITS, spec, [3], [5], [1, 1]).token_ids) for _ in range(5)}
    assert len(runs) == 1
