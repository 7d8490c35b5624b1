"""Speculative decoding through the offline LLM (``LLM(speculative_config=...)``): greedy tokens
equal those of one-token steps on the demo model and on SmolLM2-135M-Instruct, except at
near-ties, each of which is reported with its top-two logit gap; sampled requests run and
end as asked."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}
# Below this top-two gap the verification pass and a one-token step may order two tokens
# differently (their sums run in another order); a difference at a larger gap is a bug.
NEAR_TIE = 1e-3

TASKS = [
    "Copy this sentence exactly: The lighthouse at Carrick Point was built in 1852 to guard the "
    "narrow channel between the harbour and the open sea.",
    "Rename compute_total to order_total and return the code:\n\ndef compute_total(items):\n"
    "    total = 0\n    for item in items:\n        total += item.price\n    return total\n",
    "Repeat the list: apples, pears, plums, cherries, apples, pears, plums, cherries.",
]


def make(model: str | None, speculative: bool, **kwargs) -> LLM:
    torch.manual_seed(0)
    return LLM(
        model=model,
        dtype="float32",
        kv_cache_memory=kwargs.pop("kv_cache_memory", 64 << 20),
        speculative_config=NGRAM if speculative else None,
        **kwargs,
    )


def top_two_gap(llm: LLM, prompt_ids: list[int]) -> float:
    """The gap between the two largest logits after ``prompt_ids`` (a one-token step)."""
    out = llm.generate(
        [{"prompt_token_ids": prompt_ids}],
        SamplingParams(temperature=0, max_tokens=1, logprobs=2),
        use_tqdm=False,
    )[0]
    values = sorted(out.outputs[0].logprobs[0].values(), reverse=True)
    return values[0] - values[1]


def compare(off: LLM, on: LLM, prompts: list, params: SamplingParams) -> list[str]:
    """Greedy outputs of both; every difference must be a near-tie. Returns the report."""
    a = off.generate(prompts, params, use_tqdm=False)
    b = on.generate(prompts, params, use_tqdm=False)
    report = []
    for x, y in zip(a, b, strict=True):
        want, got = x.outputs[0].token_ids, y.outputs[0].token_ids
        if want == got:
            assert x.outputs[0].text == y.outputs[0].text
            continue
        k = next(i for i, (p, q) in enumerate(zip(want, got, strict=False)) if p != q)
        gap = top_two_gap(off, x.prompt_token_ids + want[:k])
        report.append(f"prompt {x.prompt[:30]!r}: differs at output {k}, top-two gap {gap:.2e}")
        assert gap < NEAR_TIE, report[-1]
    print("\n".join(report) or "no differences")
    return report


@pytest.fixture(scope="module")
def demo_pair():
    return make(None, False), make(None, True)


def test_greedy_demo_model_tokens_are_those_of_one_token_steps(demo_pair) -> None:
    off, on = demo_pair
    prompts = [*TASKS, {"prompt_token_ids": list(range(40, 60)) * 3}]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, repetition_penalty=1.1)
    compare(off, on, prompts, params)
    stats = on.engine.stats().spec_decode
    assert stats is not None and stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert off.engine.stats().spec_decode is None


def test_sampled_requests_run_and_end_as_asked(demo_pair) -> None:
    _, on = demo_pair
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=30, n=2, seed=1)
    outputs = on.generate(TASKS, params, use_tqdm=False)
    for out in outputs:
        assert len(out.outputs) == 2
        for choice in out.outputs:
            assert 1 <= len(choice.token_ids) <= 30
            assert choice.finish_reason in ("stop", "length")
    # seeded: the same again
    again = on.generate(TASKS, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [
        [c.token_ids for c in o.outputs] for o in again
    ]


def test_logprobs_requests_step_without_drafts_and_keep_their_logprobs(demo_pair) -> None:
    off, on = demo_pair
    before = on.engine.stats().spec_decode.num_drafts
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2)
    a = off.generate(TASKS[:1], params, use_tqdm=False)[0].outputs[0]
    b = on.generate(TASKS[:1], params, use_tqdm=False)[0].outputs[0]
    assert on.engine.stats().spec_decode.num_drafts == before
    assert a.token_ids == b.token_ids and len(b.logprobs) == len(b.token_ids)


def test_preemption_on_a_tiny_cache_keeps_greedy_tokens(demo_pair) -> None:
    # About 24 blocks of 16 tokens for 6 sequences that grow to 100 tokens each: they preempt.
    runner = demo_pair[0].engine.runner
    block_bytes = (64 << 20) // runner.num_blocks
    off = make(None, False, kv_cache_memory=24 * block_bytes, max_num_seqs=6, max_model_len=256)
    on = make(None, True, kv_cache_memory=24 * block_bytes, max_num_seqs=6, max_model_len=256)
    prompts = [{"prompt_token_ids": [7 + i, 8, 9, 10] * 10} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    compare(off, on, prompts, params)
    assert on.engine.stats().num_preemptions > 0
    assert on.engine.stats().spec_decode.num_accepted_tokens > 0


def test_greedy_smollm2_tokens_are_those_of_one_token_steps() -> None:
    off = make("smollm2", False, max_model_len=1024)
    on = make("smollm2", True, max_model_len=1024)
    tokenizer = off.get_tokenizer()
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": task}], tokenize=False, add_generation_prompt=True
        )
        for task in TASKS
    ]
    compare(off, on, prompts, SamplingParams(temperature=0, max_tokens=64))
    stats = on.engine.stats().spec_decode
    assert stats is not None and stats.num_accepted_tokens > 0
