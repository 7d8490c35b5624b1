"""Held-back deltas of requests answered once: the API server ends with the same output."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from pagedllm.core.output_buffer import OutputBuffer, merge
from pagedllm.core.request_delta import RequestDelta, RequestTimings, SeqDelta
from pagedllm.models.demo import demo_model_dir
from pagedllm.output.processor import RequestOutputState
from pagedllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(demo_model_dir())


@pytest.fixture(scope="module")
def words(tokenizer) -> list[int]:
    """Tokens that are whole printable words (how tokens split a multi-byte character is the
    detokenizer's business, not the buffer's)."""
    return [i for i in range(len(tokenizer)) if tokenizer.decode([i]).strip().isalpha()]


def random_trace(
    rng: random.Random,
    request_id: str,
    n: int,
    logprobs: bool,
    prompt_logprobs: bool,
    words: list[int],
) -> list[RequestDelta]:
    """The deltas the scheduler could send for one request: steps of new tokens for its live
    sequences, each ending at some step, the last delta finished."""
    steps = rng.randint(1, 12)
    ends = {i: rng.randint(1, steps) for i in range(n)}
    ends[rng.randrange(n)] = steps
    cumulative = dict.fromkeys(range(n), 0.0)
    deltas = []
    for step in range(1, steps + 1):
        seqs = []
        for i in range(n):
            if step > ends[i]:
                continue
            tokens = [rng.choice(words) for _ in range(rng.choice((1, 1, 1, 2)))]
            lps = None
            if logprobs:
                lps = [{t: -rng.random(), t + 1: -2.0} for t in tokens]
                cumulative[i] += sum(lp[t] for lp, t in zip(lps, tokens, strict=True))
            finish = rng.choice(("length", "stop")) if step == ends[i] else None
            seqs.append(
                SeqDelta(i, tokens, lps, cumulative[i], finish, 7 if finish == "stop" else None)
            )
        last = step == steps
        deltas.append(
            RequestDelta(
                request_id,
                seqs,
                prompt_logprobs=[None, {9: -0.5}] if prompt_logprobs and step == 1 else [],
                finished=last,
                final_order=list(reversed(range(n))) if last and n > 1 else None,
                timings=RequestTimings(10.0, 10.1, 10.2, 10.9) if last else None,
            )
        )
    return deltas


def applied(deltas: list[RequestDelta], tokenizer, n: int):
    params = SamplingParams(n=n, logprobs=1, prompt_logprobs=1)
    state = RequestOutputState("r", "p", [1, 2], params, tokenizer, 0.0)
    for delta in deltas:
        state.update(delta)
    return state.output()


@pytest.mark.parametrize("seed", range(40))
def test_held_deltas_give_the_same_output(seed: int, tokenizer, words: list[int]):
    rng = random.Random(seed)
    n = rng.choice((1, 1, 2, 3))
    trace = random_trace(rng, "r", n, rng.random() < 0.5, rng.random() < 0.5, words)
    buffer = OutputBuffer()
    buffer.hold_after_first("r")
    sent: list[list[RequestDelta]] = [buffer.route([d], now=float(i)) for i, d in enumerate(trace)]

    flat = [d for step in sent for d in step]
    assert applied(flat, tokenizer, n) == applied(trace, tokenizer, n)
    # The first step goes out at once (time to first token), then nothing until the end.
    assert sent[0] == [trace[0]]
    assert all(step == [] for step in sent[1:-1])
    if len(trace) > 1:
        (last,) = sent[-1]
        assert last.finished and last.timings == trace[-1].timings
        assert last.step_times == [float(i) for i in range(1, len(trace))]
    assert len(buffer) == 0


def test_other_requests_pass_through_in_order(words: list[int]):
    rng = random.Random(7)
    held = random_trace(rng, "held", 2, True, False, words)
    streamed = random_trace(rng, "streamed", 1, False, False, words)
    buffer = OutputBuffer()
    buffer.hold_after_first("held")
    out = []
    for i in range(max(len(held), len(streamed))):
        out.extend(buffer.route(held[i : i + 1] + streamed[i : i + 1], now=float(i)))
    assert [d for d in out if d.request_id == "streamed"] == streamed
    assert [d.step_times for d in streamed] == [[] for _ in streamed]


def test_an_error_before_the_first_token_is_sent_and_forgotten():
    buffer = OutputBuffer()
    buffer.hold_after_first("r")
    error = RequestDelta("r", finished=True, error="prompt too long")
    assert buffer.route([error], now=0.0) == [error]
    assert len(buffer) == 0


def test_forget_drops_what_was_held():
    buffer = OutputBuffer()
    buffer.hold_after_first("r")
    first = RequestDelta("r", [SeqDelta(0, [5], None, 0.0)])
    second = RequestDelta("r", [SeqDelta(0, [6], None, 0.0)])
    assert buffer.route([first, second], now=0.0) == [first]
    buffer.forget("r")
    assert len(buffer) == 0


def test_merge_keeps_the_prompt_logprobs_sent_once():
    first = RequestDelta("r", [SeqDelta(0, [5], None, 0.0)], prompt_logprobs=[None, {3: -1.0}])
    later = RequestDelta("r", [SeqDelta(0, [6], None, 0.0), SeqDelta(1, [7], None, 0.0)])
    merged = merge(first, later)
    assert merged.prompt_logprobs == [None, {3: -1.0}]
    assert [(s.index, s.new_token_ids) for s in merged.seqs] == [(0, [5, 6]), (1, [7])]
