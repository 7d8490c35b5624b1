"""The engine end to end against Hugging Face transformers, on tiny random checkpoints.

Greedy outputs must equal transformers' ``generate`` token for token whatever the engine does
underneath: block sizes, mixed batches, chunked prefill, preemption, prefix-cache hits.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.llm_engine import LLMEngine
from pagedllm_testing.tiny_models import save_engine_model

VOCAB = 128
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    eos_token_id=None,
    bos_token_id=None,
)
ARCHITECTURES = {
    "llama": LlamaConfig(**TINY),
    "mistral": MistralConfig(**TINY, sliding_window=24),
    "qwen2": Qwen2Config(**TINY),
    "qwen3": Qwen3Config(**TINY, head_dim=32),
}
NEW_TOKENS = 8


def kv_bytes_per_token(arch: str = "llama") -> int:
    """2 (K, V) * layers * KV heads * head dim * 4 bytes."""
    config = ARCHITECTURES[arch]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // 4
    return 2 * 2 * 2 * head_dim * 4


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One saved checkpoint per architecture, with its transformers model."""
    out = {}
    for name, config in ARCHITECTURES.items():
        directory = tmp_path_factory.mktemp(name)
        out[name] = (directory, save_engine_model(directory, config))
    return out


def prompts(lengths, seed=0, prefix=()):
    g = torch.Generator().manual_seed(seed)
    return [list(prefix) + torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    config = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt) :].tolist()


def generate_ids(llm: LLM, batch, params=GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def make_llm(directory, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", 512 * kv_bytes_per_token("qwen3"))
    return LLM(str(directory), dtype="float32", **kwargs)


MIXED = (3, 16, 21, 40, 7)


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_greedy_matches_transformers_generate(checkpoints, arch, block_size):
    directory, model = checkpoints[arch]
    batch = prompts(MIXED, seed=block_size)
    llm = make_llm(directory, block_size=block_size)
    assert generate_ids(llm, batch) == [hf_greedy(model, p) for p in batch]


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_chunked_prefill_preemption_and_prefix_hits_keep_greedy_exact(checkpoints, arch):
    directory, model = checkpoints[arch]
    shared = prompts([48], seed=7)[0]
    batch = prompts(MIXED, seed=3) + prompts((5, 9, 30), seed=4, prefix=shared)
    expected = [hf_greedy(model, p) for p in batch]

    chunked = make_llm(directory, block_size=8, max_num_batched_tokens=6)
    assert generate_ids(chunked, batch) == expected

    # 14 blocks of 8 tokens cannot hold the whole batch at once: requests get preempted.
    tight = make_llm(
        directory,
        block_size=8,
        kv_cache_memory=14 * 8 * kv_bytes_per_token(arch),
        max_model_len=100,
        enable_prefix_caching=False,
    )
    assert generate_ids(tight, batch) == expected
    assert tight.engine.stats().num_preemptions > 0

    cached = make_llm(directory, block_size=8)
    # One prompt with the shared prefix first: the others then find its 6 blocks cached.
    assert generate_ids(cached, batch[-1:]) == expected[-1:]
    assert generate_ids(cached, batch) == expected
    first_hits = cached.engine.stats().prefix_hits
    assert first_hits >= 3 * 48
    # The same prompts again: every full block of each prompt is a hit.
    assert generate_ids(cached, batch) == expected
    assert cached.engine.stats().prefix_hits - first_hits >= sum(len(p) for p in batch) - 8 * 8
    assert cached.engine.stats().kv_usage == 0.0


def test_prompt_that_fills_whole_blocks_recomputes_only_its_last_token(checkpoints):
    directory, model = checkpoints["llama"]
    prompt = prompts([32], seed=11)[0]
    llm = make_llm(directory, block_size=16)
    engine = llm.engine
    assert generate_ids(llm, [prompt]) == [hf_greedy(model, prompt)]
    engine.add_request({"prompt_token_ids": prompt}, GREEDY, request_id="again")
    plan = engine.scheduler.schedule()
    assert plan.scheduled == [(plan.new[0].seq_id, 1)]
    assert plan.new[0].num_computed_tokens == 31 and plan.new[0].num_kv_tokens == 32
    result = engine.runner.execute(plan)
    engine.scheduler.update(plan, result)
    assert result.samples[0].token_ids[0] == hf_greedy(model, prompt)[0]
    engine.abort_request("again")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prompt_logprobs_equal_transformers_log_softmax(checkpoints, arch):
    directory, model = checkpoints[arch]
    prompt = prompts([19], seed=5)[0]
    llm = make_llm(directory, block_size=8, max_num_batched_tokens=8)
    out = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(max_tokens=1, prompt_logprobs=2),
        use_tqdm=False,
    )[0]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert abs(entry[prompt[pos]] - ref[pos - 1, prompt[pos]].item()) < 1e-4
        top = torch.topk(ref[pos - 1], 2)
        for token, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert abs(entry[token] - value) < 1e-4


def blocks_in_use(engine: LLMEngine) -> int:
    return engine.scheduler.block_manager.pool.num_used


def step_until(engine: LLMEngine, condition, limit=50) -> None:
    for _ in range(limit):
        if condition():
            return
        engine.step()
    raise AssertionError("condition not reached")


@pytest.mark.parametrize("kind", ["n", "beam"])
def test_four_sequences_share_the_prompt_blocks(checkpoints, kind):
    directory, _ = checkpoints["llama"]
    prompt = prompts([64], seed=9)[0]  # exactly 4 blocks of 16
    llm = make_llm(directory, block_size=16, enable_prefix_caching=False)
    engine = llm.engine
    params = (
        SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=20, ignore_eos=True)
        if kind == "n"
        else BeamSearchParams(beam_width=4, max_tokens=20).to_sampling_params()
    )
    engine.add_request({"prompt_token_ids": prompt}, params, request_id="r")
    request = engine.scheduler.requests["r"]
    step_until(engine, lambda: len([s for s in request.seqs if s.num_output_tokens >= 2]) == 4)
    prompt_blocks = request.seqs[0].blocks.ids[:4]
    pool = engine.scheduler.block_manager.pool
    for block_id in prompt_blocks:
        assert pool.blocks[block_id].ref_count == 4
        assert all(s.blocks.ids[:4] == prompt_blocks for s in request.seqs)
    # 4 shared prompt blocks plus at most one own block per sequence (beams forked from one
    # parent may still share theirs), against 4 * 5 without sharing.
    assert 4 + 1 <= blocks_in_use(engine) <= 4 + 4
    while engine.has_unfinished_requests():
        engine.step()
    assert blocks_in_use(engine) == 0


def reference_beam_search(model, prompt: list[int], width: int, steps: int):
    """Textbook beam search over transformers' logits: extend each beam by its 2 * width
    best tokens, keep the width best by cumulative log probability."""
    beams = [(list(prompt), 0.0)]
    for _ in range(steps):
        candidates = []
        for tokens, score in beams:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1].float()
            top = torch.topk(torch.log_softmax(logits, dim=-1), 2 * width)
            for token, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                candidates.append((tokens + [token], score + value))
        beams = sorted(candidates, key=lambda c: -c[1])[:width]
    return beams


def test_beam_search_equals_a_reference_beam_search(checkpoints):
    directory, model = checkpoints["llama"]
    batch = prompts((6, 13), seed=21)
    llm = make_llm(directory, block_size=8)
    beams = llm.beam_search(
        [{"prompt_token_ids": p} for p in batch],
        BeamSearchParams(beam_width=4, max_tokens=6, ignore_eos=True),
    )
    for prompt, result in zip(batch, beams, strict=True):
        expected = reference_beam_search(model, prompt, width=4, steps=6)
        assert [s.tokens for s in result.sequences] == [tokens for tokens, _ in expected]
        for ours, (_, score) in zip(result.sequences, expected, strict=True):
            assert abs(ours.cum_logprob - score) < 1e-4
    assert llm.engine.stats().kv_usage == 0.0


def test_seeded_sampling_is_reproducible_across_runs_and_batches(checkpoints):
    directory, _ = checkpoints["qwen2"]
    target = prompts([12], seed=1)[0]
    others = prompts((4, 30, 17), seed=2)
    params = SamplingParams(
        temperature=0.9,
        top_p=0.9,
        top_k=40,
        seed=1234,
        max_tokens=12,
        ignore_eos=True,
        presence_penalty=0.5,
        repetition_penalty=1.2,
    )
    alone = generate_ids(make_llm(directory), [target], params)[0]
    again = generate_ids(make_llm(directory), [target], params)[0]
    llm = make_llm(directory, max_num_batched_tokens=16)
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    mixed = llm.generate(
        [{"prompt_token_ids": p} for p in [others[0], target, *others[1:]]],
        [unseeded, params, unseeded, unseeded],
        use_tqdm=False,
    )
    assert alone == again == mixed[1].outputs[0].token_ids
    other_seed = generate_ids(llm, [target], SamplingParams(**{**_fields(params), "seed": 99}))
    assert other_seed[0] != alone
    fanned = llm.generate(
        {"prompt_token_ids": target}, SamplingParams(**{**_fields(params), "n": 3}), use_tqdm=False
    )[0]
    assert fanned.outputs[0].token_ids == alone
    assert len({tuple(o.token_ids) for o in fanned.outputs}) == 3


def _fields(params: SamplingParams) -> dict:
    return {
        k: getattr(params, k) for k in SamplingParams.__dataclass_fields__ if k != "stop_strings"
    }


def test_stop_tokens_and_stop_strings_end_output_exactly():
    llm = LLM(kv_cache_memory=32 << 20)  # the demo model: its tokens decode to real text
    prompt = "The river ran past the old mill"
    long = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = llm.generate(prompt, long, use_tqdm=False)[0].outputs[0]
    stop_token = full.token_ids[5]
    first = full.token_ids.index(stop_token)
    with_stop_token = SamplingParams(**{**_fields(long), "stop_token_ids": [stop_token]})
    by_token = llm.generate(prompt, with_stop_token, use_tqdm=False)[0].outputs[0]
    assert by_token.token_ids == full.token_ids[: first + 1]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", stop_token)

    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "the random model must produce some text to cut"
    cut = text.index(stop)
    by_string = llm.generate(
        prompt, SamplingParams(**{**_fields(long), "stop": [stop]}), use_tqdm=False
    )[0].outputs[0]
    assert by_string.text == text[:cut]
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", stop)
    kept = llm.generate(
        prompt,
        SamplingParams(**{**_fields(long), "stop": stop, "include_stop_str_in_output": True}),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == text[: cut + len(stop)]
    capped = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert capped.token_ids == full.token_ids[:4] and capped.finish_reason == "length"
    assert llm.engine.stats().kv_usage == 0.0


def test_eos_and_min_tokens(checkpoints, tmp_path):
    directory, _ = checkpoints["llama"]
    llm = make_llm(directory)
    prompt = {"prompt_token_ids": prompts([10], seed=3)[0]}
    full = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    eos = full.token_ids[2]
    llm.engine.eos_token_ids = (eos,)
    ended = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[
        0
    ].outputs[0]
    assert ended.token_ids == full.token_ids[: full.token_ids.index(eos) + 1]
    assert ended.finish_reason == "stop" and ended.stop_reason is None
    held = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=24, min_tokens=10), use_tqdm=False
    )[0].outputs[0]
    assert len(held.token_ids) >= 10
    assert eos not in held.token_ids[:10]


INVALID = [
    ("n", 0),
    ("best_of", 0),
    ("presence_penalty", 3.0),
    ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0),
    ("temperature", -0.1),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -5),
    ("min_p", 1.5),
    ("seed", "x"),
    ("max_tokens", 0),
    ("min_tokens", -1),
    ("logprobs", -1),
    ("prompt_logprobs", -2),
    ("stop", [""]),
    ("stop_token_ids", [-1]),
]


@pytest.mark.parametrize(("field", "value"), INVALID)
def test_every_invalid_sampling_field_is_rejected_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_requests_that_cannot_fit_end_with_an_error_and_others_go_on(checkpoints):
    directory, model = checkpoints["llama"]
    llm = make_llm(directory, max_model_len=40)
    ok, too_long = prompts((5, 45), seed=8)
    outs = llm.generate(
        [{"prompt_token_ids": too_long}, {"prompt_token_ids": ok}], GREEDY, use_tqdm=False
    )
    assert "45 tokens" in outs[0].error and "max_model_len is 40" in outs[0].error
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[1].outputs[0].token_ids == hf_greedy(model, ok)


def test_cache_too_small_for_max_model_len_fails_at_start_with_the_fitting_length(checkpoints):
    directory, _ = checkpoints["llama"]
    with pytest.raises(ValueError, match="max_model_len to at most 64"):
        make_llm(directory, block_size=16, kv_cache_memory=64 * kv_bytes_per_token())


def test_chat_applies_the_template_and_counts_metrics():
    llm = LLM(kv_cache_memory=32 << 20)
    messages = [{"role": "user", "content": "Say hello"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    tokenizer = llm.get_tokenizer()
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert out.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert 1 <= len(out.outputs[0].token_ids) <= 5
    assert out.metrics.first_token_time is not None and out.metrics.finished_time > 0
    stats = llm.engine.stats()
    assert stats.prompt_tokens == len(out.prompt_token_ids)
    assert stats.generation_tokens == len(out.outputs[0].token_ids)
    assert stats.num_running == stats.num_waiting == 0


def test_forked_sequences_compute_on_their_own_copies(checkpoints):
    # Greedy with n=4: every fork must continue exactly like a single greedy sequence, which
    # only holds if copy-on-write gives each its own last block.
    directory, model = checkpoints["mistral"]
    batch = prompts((13, 16, 5), seed=31)
    llm = make_llm(directory, block_size=8)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in batch],
        SamplingParams(n=4, temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    for prompt, out in zip(batch, outs, strict=True):
        expected = hf_greedy(model, prompt, 12)
        assert [o.token_ids for o in out.outputs] == [expected] * 4


def test_triton_kernels_give_the_same_greedy_tokens_as_torch(checkpoints):
    # On the CPU the Triton kernels run in the interpreter: keep the case small.
    directory, _ = checkpoints["qwen2"]
    batch = prompts((5, 19), seed=41)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    torch_path = generate_ids(
        make_llm(directory, block_size=8, kernel_backend="torch"), batch, params
    )
    triton_path = generate_ids(
        make_llm(directory, block_size=8, kernel_backend="triton"), batch, params
    )
    assert triton_path == torch_path


def test_extreme_but_valid_sampling_values_stay_sane(checkpoints):
    directory, model = checkpoints["llama"]
    prompt = prompts([9], seed=13)[0]
    llm = make_llm(directory)
    expected = hf_greedy(model, prompt, 4)
    for params in (
        SamplingParams(temperature=1e-38, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=1e-46, max_tokens=4, ignore_eos=True, seed=0),
        SamplingParams(temperature=1.0, top_k=1, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=1.0, max_tokens=4, ignore_eos=True, seed=0),
    ):
        # Each of these leaves only the most likely token.
        assert generate_ids(llm, [prompt], params) == [expected], params
