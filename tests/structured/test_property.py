"""Property: whatever constraint is drawn, every output that ends by itself (``stop``) obeys
it: JSON that validates against its schema, text that full-matches its regex, one of the
choices. The demo model samples at temperature 1, so the grammar alone keeps it in line; with
n = 4 samples, and with a KV cache so small that sequences are preempted and recomputed."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm_testing.strategies import choices, json_schemas, regexes

# The demo model's KV cache holds 4 KiB a token: 12 blocks of 16 tokens. The prompt's 4 blocks
# (3 full ones) are shared by the n = 4 samples, whose outputs need 2 to 4 blocks each.
TINY_KV_CACHE = 768 << 10
TINY_MAX_MODEL_LEN = 192
LONG_PROMPT = "Write it down, every field of it, in the form asked for and nothing else. " * 2
MAX_TOKENS = 120
# No shrinking: each example runs the model for a while, and a failure shows its constraint.
PROPERTY = settings(
    max_examples=5,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory=32 << 20)


@pytest.fixture(scope="module")
def tiny() -> Iterator[LLM]:
    llm = LLM(kv_cache_memory=TINY_KV_CACHE, max_model_len=TINY_MAX_MODEL_LEN)
    yield llm
    assert llm.engine.scheduler.num_preemptions > 0, "the tiny cache never preempted"


def _generate(
    llm: LLM, constraint: StructuredOutputsParams, n: int, seed: int, prompt: str = "Write:"
) -> list:
    params = SamplingParams(
        n=n, temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, structured_outputs=constraint
    )
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert len(out.outputs) == n
    return out.outputs


def _check_json(outputs: list, schema: dict) -> int:
    finished = [o for o in outputs if o.finish_reason == "stop"]
    for o in finished:
        jsonschema.validate(json.loads(o.text), schema)
    return len(finished)


@PROPERTY
@given(schema=json_schemas(), seed=st.integers(0, 2**31))
def test_json_outputs_validate(llm: LLM, schema: dict, seed: int) -> None:
    # With whitespace allowed a random model may spend its tokens on it: outputs cut short
    # are not checked, the compact runs below must finish.
    _check_json(_generate(llm, StructuredOutputsParams(json=schema), 4, seed), schema)


@pytest.mark.timeout(1800)  # a shared machine can be slow; the sample is small already
@PROPERTY
@given(schema=json_schemas(), seed=st.integers(0, 2**31))
def test_json_outputs_validate_through_preemption(tiny: LLM, schema: dict, seed: int) -> None:
    compact = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    outputs = _generate(tiny, compact, 4, seed, LONG_PROMPT)
    assert _check_json(outputs, schema) >= 1, [o.text for o in outputs]


@pytest.mark.timeout(1800)
@PROPERTY
@given(pattern=regexes(), seed=st.integers(0, 2**31))
def test_regex_outputs_full_match(tiny: LLM, pattern: str, seed: int) -> None:
    outputs = _generate(tiny, StructuredOutputsParams(regex=pattern), 4, seed, LONG_PROMPT)
    finished = [o.text for o in outputs if o.finish_reason == "stop"]
    assert finished, [o.text for o in outputs]
    for text in finished:
        assert re.fullmatch(pattern, text), (pattern, text)


@PROPERTY
@given(options=choices(), seed=st.integers(0, 2**31))
def test_choice_outputs_are_choices(llm: LLM, options: list[str], seed: int) -> None:
    for o in _generate(llm, StructuredOutputsParams(choice=options), 4, seed):
        assert o.finish_reason == "stop"
        assert o.text in options
