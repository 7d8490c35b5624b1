"""Speculative decoding in the core: the n-gram proposer, the settings, and how the scheduler
counts, cuts and gives back draft tokens."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedllm.core.ngram_proposer import propose
from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from pagedllm.core.speculative import SpeculativeConfig, parse_speculative_config
from pagedllm.core.step_plan import SeqSample, StepResult
from pagedllm.sampling_params import SamplingParams


def reference_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """vLLM's rule spelled out: the longest n, then its earliest earlier occurrence."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


@given(
    tokens=st.lists(st.integers(0, 3), min_size=0, max_size=40),
    k=st.integers(1, 5),
    bounds=st.tuples(st.integers(1, 4), st.integers(0, 3)),
)
def test_the_proposer_finds_the_longest_earliest_match(
    tokens: list[int], k: int, bounds: tuple[int, int]
) -> None:
    min_n, extra = bounds
    assert propose(tokens, k, min_n, min_n + extra) == reference_propose(
        tokens, k, min_n, min_n + extra
    )


def test_the_proposer_on_text_that_repeats() -> None:
    # "the cat sat on the" -> "cat sat on" follows the earlier "the"
    assert propose([1, 2, 3, 4, 1], 3, 1, 3) == [2, 3, 4]
    # the longer match wins over a later shorter one
    assert propose([7, 8, 9, 5, 8, 6, 7, 8], 2, 1, 2) == [9, 5]
    assert propose([1, 2, 3, 4, 5], 3, 1, 3) == []
    assert propose([1, 2, 1, 2], 3, 3, 4) == []  # the tail [2, 1, 2] occurs nowhere before


def test_settings_follow_vllm() -> None:
    config = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}'
    )
    assert config == SpeculativeConfig("ngram", 4, 4, 2)
    only_max = parse_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    )
    assert only_max is not None and only_max.prompt_lookup_min == 3
    neither = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3})
    assert neither is not None and (neither.prompt_lookup_min, neither.prompt_lookup_max) == (5, 5)
    assert parse_speculative_config(None) is None
    assert parse_speculative_config(config.to_json()) == config


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "unknown method 'eagle'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "must be at most 16"),
        ({"method": "ngram", "num_speculative_tokens": True}, "positive integer, got True"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min (4) must not exceed prompt_lookup_max (2)",
        ),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"num_speculative_tokens": 2}, '"method" is required'),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "unknown keys ['model']"),
        ("{not json", "not JSON"),
        ("[1]", "must be an object"),
    ],
)
def test_bad_settings_say_what_is_wrong(value: object, message: str) -> None:
    with pytest.raises(ValueError) as error:
        parse_speculative_config(value)  # type: ignore[arg-type]
    assert message in str(error.value)


SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)


def scheduler(
    num_blocks: int = 16, max_model_len: int = 64, spec: SpeculativeConfig = SPEC
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks,
            block_size=4,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            max_model_len=max_model_len,
            speculative=spec,
        )
    )


def step(s: Scheduler, answer) -> list:
    """One synchronous step; ``answer(seq_id, draft)`` gives the workers' tokens."""
    plan = s.schedule()
    samples = [
        SeqSample(seq_id, tokens := answer(seq_id, plan.drafts.get(seq_id)), [0.0] * len(tokens))
        for seq_id, _ in plan.scheduled
    ]
    return [plan, s.update(plan, StepResult(plan.step_id, samples))]


PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1]


def test_accepted_drafts_count_as_computed_and_rejected_slots_go_back() -> None:
    s = scheduler()
    s.add_request("r", PROMPT, SamplingParams(max_tokens=20, ignore_eos=True))
    step(s, lambda i, d: [2])  # prefill: output [2]
    seq = s.running[0]
    plan, _ = step(s, lambda i, d: d[:1] + [9])  # draft [3, 4, 5, 1]: one accepted, then 9
    assert plan.drafts[seq.seq_id] == [3, 4, 5, 1]
    assert plan.scheduled == [(seq.seq_id, 5)]
    assert seq.token_ids[len(PROMPT) :] == [2, 3, 9]
    # K/V for all but the newest token; blocks only for what that holds
    assert seq.num_computed_tokens == seq.num_kv_tokens == len(PROMPT) + 2
    assert len(seq.blocks.ids) == -(-(len(PROMPT) + 2) // 4)
    stats = s.stats().spec_decode
    assert stats is not None
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 4, 1)
    assert stats.accepted_per_pos == [1, 0, 0, 0]


def test_max_tokens_cuts_the_draft_and_the_accepted_tokens() -> None:
    s = scheduler()
    s.add_request("r", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
    step(s, lambda i, d: [2])
    plan, deltas = step(s, lambda i, d: d + [7])
    # two outputs left: one draft at most, and the step yields exactly two
    assert [len(d) for d in plan.drafts.values()] == [1]
    assert deltas[-1].finished
    assert deltas[-1].seqs[0].new_token_ids == [3, 7]
    assert s.block_manager.usage == 0.0


def test_a_stop_token_inside_the_accepted_drafts_ends_there() -> None:
    s = scheduler()
    s.add_request("r", PROMPT, SamplingParams(max_tokens=20, stop_token_ids=[4]))
    step(s, lambda i, d: [2])
    _, deltas = step(s, lambda i, d: d + [7])  # accepts [3, 4, 5, 1]; 4 stops it
    final = deltas[-1].seqs[0]
    assert final.new_token_ids == [3, 4] and final.finish_reason == "stop"
    assert s.block_manager.usage == 0.0


def test_a_sequence_whose_drafts_fail_pauses_them() -> None:
    s = scheduler()
    s.add_request("r", PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))
    step(s, lambda i, d: [2])
    drafted = []
    for _ in range(8):
        plan, _ = step(s, lambda i, d: [9] if d is None else [6 if d[0] != 6 else 7])
        drafted.append(bool(plan.drafts))
    # miss, pause 2, miss, pause 4, ...: drafts get rarer
    assert drafted[:4] == [True, False, False, True]
    assert sum(drafted) <= 3


def test_requests_that_cannot_speculate_step_one_token_at_a_time() -> None:
    s = scheduler()
    s.add_request("lp", PROMPT, SamplingParams(max_tokens=5, logprobs=1, ignore_eos=True))
    step(s, lambda i, d: [2])
    plan, _ = step(s, lambda i, d: [3])
    assert plan.drafts == {}


def test_drafts_without_free_blocks_are_dropped_not_preempting() -> None:
    # 3 blocks of 4: the prompt and first output fill them; a draft would need a fourth
    s = scheduler(num_blocks=3)
    s.add_request("r", PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))
    step(s, lambda i, d: [2])
    plan, _ = step(s, lambda i, d: [3])
    assert plan.drafts == {} and plan.num_tokens == 1
    assert s.num_preemptions == 0


def test_disable_by_batch_size_defaults_to_16_and_null_means_never() -> None:
    base = {"method": "ngram", "num_speculative_tokens": 2}
    default = parse_speculative_config(base)
    assert default is not None and default.disable_by_batch_size == 16
    never = parse_speculative_config(base | {"disable_by_batch_size": None})
    assert never is not None and never.disable_by_batch_size is None
    assert parse_speculative_config(never.to_json()) == never
    with pytest.raises(ValueError, match="disable_by_batch_size must be a positive integer"):
        parse_speculative_config(base | {"disable_by_batch_size": 0})


@pytest.mark.parametrize(("most", "requests", "drafts"), [(2, 2, True), (2, 3, False)])
def test_no_drafts_while_more_requests_than_disable_by_batch_size(
    most: int, requests: int, drafts: bool
) -> None:
    """Above the bound every sequence steps one token at a time, and the node plans ahead
    again (async scheduling); at it, each drafts."""
    spec = SpeculativeConfig(
        num_speculative_tokens=4,
        prompt_lookup_max=3,
        prompt_lookup_min=1,
        disable_by_batch_size=most,
    )
    s = scheduler(num_blocks=64, spec=spec)
    for i in range(requests):
        s.add_request(f"r{i}", PROMPT, SamplingParams(max_tokens=20, ignore_eos=True))
    step(s, lambda i, d: [2])  # the prefills: each has output [2]
    plan = s.schedule()
    assert len(plan.scheduled) == requests
    assert bool(plan.drafts) == drafts
    if drafts:
        assert len(plan.drafts) == requests
    else:
        assert s.schedule_ahead(plan) is not None
