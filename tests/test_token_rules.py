"""logit_bias, allowed_token_ids and bad_words on the offline engine (demo model, sampling)."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory=16 << 20)


def _tokens(llm: LLM, **settings: object) -> list[list[int]]:
    params = SamplingParams(max_tokens=24, n=4, seed=11, ignore_eos=True, **settings)
    (out,) = llm.generate(["Once upon a time"], params, use_tqdm=False)
    return [list(o.token_ids) for o in out.outputs]


def test_allowed_token_ids(llm: LLM) -> None:
    allowed = [100, 200, 300]
    for tokens in _tokens(llm, allowed_token_ids=allowed):
        assert set(tokens) <= set(allowed)


def test_logit_bias_forces_and_forbids(llm: LLM) -> None:
    for tokens in _tokens(llm, logit_bias={777: 100.0}):
        assert set(tokens) == {777}
    usual = {t for seq in _tokens(llm) for t in seq}
    for tokens in _tokens(llm, logit_bias={t: -100.0 for t in usual}):
        assert not set(tokens) & usual


def test_bad_words_are_never_written(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    usual = [tokenizer.decode([t]) for seq in _tokens(llm) for t in seq]
    words = sorted({w.strip() for w in usual if w.strip().isalpha()})[:5]
    assert words
    for tokens in _tokens(llm, bad_words=words):
        text = tokenizer.decode(tokens)
        for word in words:
            assert f" {word} " not in f" {text} ", (word, text)
