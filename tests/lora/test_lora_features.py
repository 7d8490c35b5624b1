"""Adapters with the engine's other features: a request keeps its adapter through preemption,
n > 1 sampling, beam search, speculative decoding and structured outputs (on the demo model,
against the same adapter served plainly)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from pagedllm import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from pagedllm.lora.request import LoRARequest
from pagedllm_testing.lora_adapters import demo_adapter

MAX_TOKENS = 24
# Prompts that repeat themselves, so that n-gram speculation has drafts to propose.
PROMPTS = [[(7 * i + k) % 50 + 3 for k in range(6)] * 3 + [(5 * i + 11) % 40 + 2] for i in range(6)]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SETTINGS = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "dtype": "float32"}
# Below this top-two gap two forward passes of different shapes may order two tokens
# differently (their sums run in another order); a difference at a larger gap is a bug.
NEAR_TIE = 1e-3


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> list[LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    paths: list[Path] = [
        demo_adapter(root / "attention", seed=1, modules=("q_proj", "v_proj")),
        demo_adapter(root / "mlp", seed=2, modules=("o_proj", "gate_proj", "down_proj")),
    ]
    return [LoRARequest(p.name, i + 1, str(p)) for i, p in enumerate(paths)]


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM(kv_cache_memory=32 << 20, **SETTINGS)


def mix(adapters: list[LoRARequest]) -> list[LoRARequest | None]:
    """Each prompt's adapter: the two adapters and the base model, in turn."""
    return [[adapters[0], adapters[1], None][i % 3] for i in range(len(PROMPTS))]


def greedy(llm: LLM, loras: list[LoRARequest | None], prompts=PROMPTS) -> list[list[int]]:
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=loras
    )
    return [list(o.outputs[0].token_ids) for o in outputs]


def top_two_gap(llm: LLM, ids: list[int], lora: LoRARequest | None) -> float:
    out = llm.generate(
        {"prompt_token_ids": ids},
        SamplingParams(max_tokens=1, temperature=0.0, logprobs=2),
        use_tqdm=False,
        lora_request=lora,
    )[0]
    first, second = sorted(out.outputs[0].logprobs[0].values(), reverse=True)[:2]
    return first - second


def test_preempted_requests_keep_their_adapter(reference: LLM, adapters) -> None:
    # 10 blocks of 16 tokens for six requests of 4 blocks each: requests are preempted and
    # computed again, under their own adapter's prefix-cache root.
    tiny = LLM(kv_cache_memory=640 << 10, max_model_len=128, **SETTINGS)
    loras = mix(adapters)
    assert greedy(tiny, loras) == greedy(reference, loras)
    assert tiny.engine.scheduler.num_preemptions > 0


def test_n_samples_fork_under_their_adapter(reference: LLM, adapters) -> None:
    # Greedy samples of one request share its prompt's blocks: each equals the request alone.
    loras = mix(adapters)
    alone = greedy(reference, loras)
    outputs = reference.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(n=3, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
        lora_request=loras,
    )
    for out, want in zip(outputs, alone, strict=True):
        assert [list(c.token_ids) for c in out.outputs] == [want] * 3


def test_beam_search_scores_beams_under_the_adapter(reference: LLM, adapters) -> None:
    adapter, prompt = adapters[1], PROMPTS[0]
    (one,) = reference.beam_search(
        [{"prompt_token_ids": prompt}],
        BeamSearchParams(beam_width=1, max_tokens=8, ignore_eos=True),
        lora_request=adapter,
    )
    assert one.sequences[0].tokens == prompt + greedy(reference, [adapter], [prompt])[0][:8]
    (beams,) = reference.beam_search(
        [{"prompt_token_ids": prompt}],
        BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True),
        lora_request=adapter,
    )
    base = reference.beam_search(
        [{"prompt_token_ids": prompt}],
        BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True),
    )[0]
    assert [s.tokens for s in beams.sequences] != [s.tokens for s in base.sequences]
    for beam in beams.sequences:
        # Each beam's score is its tokens' log-probabilities under the adapter.
        scored = reference.generate(
            {"prompt_token_ids": beam.tokens},
            SamplingParams(max_tokens=1, prompt_logprobs=1),
            use_tqdm=False,
            lora_request=adapter,
        )[0]
        positions = range(len(prompt), len(beam.tokens))
        expected = sum(scored.prompt_logprobs[p][beam.tokens[p]] for p in positions)
        assert beam.cum_logprob == pytest.approx(expected, abs=1e-4)


def test_speculative_decoding_keeps_each_adapters_tokens(reference: LLM, adapters) -> None:
    speculating = LLM(
        kv_cache_memory=32 << 20,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        },
        **SETTINGS,
    )
    loras = mix(adapters)
    want, got = greedy(reference, loras), greedy(speculating, loras)
    for prompt, lora, a, b in zip(PROMPTS, loras, want, got, strict=True):
        if a == b:
            continue
        at = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        gap = top_two_gap(reference, prompt + a[:at], lora)
        assert gap < NEAR_TIE, f"token {at} differs at a top-two gap of {gap}"
    stats = speculating.engine.stats().spec_decode
    assert stats is not None and stats.num_accepted_tokens > 0


def test_structured_outputs_hold_under_an_adapter(reference: LLM, adapters) -> None:
    schema = {
        "type": "object",
        # Finite: a random model may spend any number of tokens on a free number or string.
        "properties": {"size": {"enum": ["S", "M", "L"]}, "ok": {"type": "boolean"}},
        "required": ["size", "ok"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        n=2,
        temperature=1.0,
        seed=3,
        max_tokens=60,
        structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
    )
    (out,) = reference.generate(["Write:"], params, use_tqdm=False, lora_request=adapters[0])
    for sample in out.outputs:
        assert sample.finish_reason == "stop"
        jsonschema.validate(json.loads(sample.text), schema)
