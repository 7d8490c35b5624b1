"""Decode steps as one C++ call (``pagedllm.models.decode_graph``) against the eager modules.

Every architecture the loader takes runs the parity schedule twice, with and without the
graph: the logits must be the same bits (the graph calls the same ops in the same order), the
KV caches the same, and both match transformers. The graph must have run the decode steps,
and only those.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.cli import build_parser
from pagedllm.config import EngineConfig
from pagedllm.kernels import cpu_extension
from pagedllm.models import cpu_linear, decode_graph
from pagedllm.models.decode_graph import DecodeGraph
from pagedllm.models.loader import load_model
from pagedllm.serve.args import serve_args
from pagedllm.worker import kv_cache
from pagedllm_testing.paged_logits import (
    CASES,
    SCHEDULE,
    assert_logits_match,
    hf_logits,
    paged_run,
    token_sequences,
)
from pagedllm_testing.tiny_models import save_hf_model

pytestmark = pytest.mark.skipif(
    not (cpu_extension.has_avx512() and cpu_extension.load()),
    reason="the decode graph multiplies through the AVX-512 panel matmul",
)

DECODE_STEPS = sum(1 for chunks in SCHEDULE if all(n == 1 for n in chunks.values()))


def run_schedule(model, tokens, cache_dtype=None):
    """The engine keeps its KV cache in the activations' dtype (the norms') unless told an
    8-bit one."""
    dtype = cache_dtype or model.model.norm.weight.dtype
    logits, run = paged_run(model, tokens, block_size=4, cache_dtype=dtype)
    return logits, run.kv_caches


def assert_same_bits(ours, eager, caches, eager_caches):
    for a, b in zip(ours, eager, strict=True):
        assert torch.equal(a, b)
    for (k, v), (k_eager, v_eager) in zip(caches, eager_caches, strict=True):
        assert torch.equal(k.view(torch.uint8), k_eager.view(torch.uint8))
        assert torch.equal(v.view(torch.uint8), v_eager.view(torch.uint8))


@pytest.fixture
def graph_calls(monkeypatch):
    calls: list[int] = []
    run = DecodeGraph.run

    def counted(self, x, *args):
        calls.append(x.shape[0])
        return run(self, x, *args)

    monkeypatch.setattr(DecodeGraph, "run", counted)
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_graph_gives_the_eager_bits_on_every_architecture(tmp_path, case, dtype, graph_calls):
    hf_model = save_hf_model(tmp_path, CASES[case])
    model, _ = load_model(tmp_path, dtype=dtype)
    # Weights in panels in either dtype: the graph's matmul, and the eager one.
    assert all(layer.mlp.down_proj.packed.panels for layer in model.model.layers)
    tokens = token_sequences()
    eager_logits, eager_caches = run_schedule(model, tokens)
    assert not graph_calls

    model.model.decode_graph = decode_graph.build(model.model)
    assert model.model.decode_graph is not None
    logits, caches = run_schedule(model, tokens)
    # Prompts and the mixed step stay eager; each decode step is one call.
    assert len(graph_calls) == DECODE_STEPS and all(n in (1, 2) for n in graph_calls)
    assert_same_bits(logits, eager_logits, caches, eager_caches)
    if dtype == "float32":  # bfloat16 against transformers: tests/models/test_smollm2.py
        assert_logits_match(logits, hf_logits(hf_model, tokens))


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", ["llama-gqa", "qwen3-qk-norm", "mistral-sliding-window"])
def test_the_graph_over_an_8bit_cache_gives_the_eager_bits(
    tmp_path, case, dtype, cache_dtype, graph_calls
):
    """``--kv-cache-dtype fp8`` and ``int8_per_token_head``: the graph writes and reads the
    8-bit cache as the eager modules do, bit for bit, and the logits stay near those of the
    model's own cache."""
    save_hf_model(tmp_path, CASES[case])
    model, _ = load_model(tmp_path, dtype=dtype)
    tokens = token_sequences()
    full_logits, _ = run_schedule(model, tokens)
    eager_logits, eager_caches = run_schedule(model, tokens, cache_dtype)
    model.model.decode_graph = decode_graph.build(model.model)
    logits, caches = run_schedule(model, tokens, cache_dtype)
    assert len(graph_calls) == DECODE_STEPS
    assert all(k.dtype == cache_dtype for k, _ in caches)
    assert_same_bits(logits, eager_logits, caches, eager_caches)
    for ours, full in zip(logits, full_logits, strict=True):
        # Tiny random models: 3 significant bits of K and V move logits of about 1 by tenths.
        assert (ours.float() - full.float()).abs().max() < 0.5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", ["llama-biases", "qwen3-qk-norm", "mistral-sliding-window"])
def test_quantized_weights_run_through_the_graph_with_the_eager_bits(
    tmp_path, case, dtype, graph_calls
):
    save_hf_model(tmp_path, CASES[case])
    model, _ = load_model(tmp_path, dtype=dtype, quantization="int8")
    assert all(
        linear.quantized is not None
        for layer in model.model.layers
        for linear in (layer.self_attn.qkv_proj, layer.mlp.down_proj)
    )
    tokens = token_sequences()
    eager_logits, eager_caches = run_schedule(model, tokens)
    model.model.decode_graph = decode_graph.build(model.model)
    assert model.model.decode_graph is not None
    logits, caches = run_schedule(model, tokens)
    assert len(graph_calls) == DECODE_STEPS
    assert_same_bits(logits, eager_logits, caches, eager_caches)


def test_models_the_graph_does_not_cover_run_eager(tmp_path, monkeypatch):
    save_hf_model(tmp_path, CASES["llama-gqa"])
    with_adapter, _ = load_model(tmp_path)
    with_adapter.model.layers[1].mlp.down_proj.lora = object()  # type: ignore[assignment]
    assert decode_graph.build(with_adapter.model) is None
    monkeypatch.setenv(cpu_linear.DISABLE_ENV, "0")
    dense, _ = load_model(tmp_path)
    assert decode_graph.build(dense.model) is None


def test_the_engine_decodes_through_the_graph_unless_told_to_stay_eager(graph_calls):
    prompts = ["The capital of France is", "One, two, three,"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for eager in (False, True):
        llm = LLM(kv_cache_memory=16 * 2**20, enforce_eager=eager)
        assert (llm.engine.runner.model.model.decode_graph is None) == eager
        before = len(graph_calls)
        outputs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert (len(graph_calls) == before) == eager
    assert outputs[False] == outputs[True]
    assert all(len(tokens) == 12 for tokens in outputs[False])


def test_enforce_eager_is_a_serve_flag():
    parser = build_parser()
    for flags, eager in ((["--enforce-eager"], True), ([], False)):
        assert (
            serve_args(parser.parse_args(["serve", *flags]), parser).engine.enforce_eager is eager
        )
    assert EngineConfig().enforce_eager is False


@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype"),
    [
        ("float32", "auto"),
        ("bfloat16", "auto"),
        ("float32", "fp8"),
        ("bfloat16", "fp8_e5m2"),
        ("bfloat16", "int8_per_token_head"),
    ],
)
def test_nothing_is_traced_or_compiled_at_any_batch_size_or_prompt_length(
    graph_calls, dtype, kv_cache_dtype
):
    """The graph takes every batch size as it comes: no trace per shape, no recompilation
    (Dynamo's counters stay at zero), one call per decode step whatever its batch, in both
    dtypes and both kinds of cache."""
    from torch._dynamo.utils import counters

    counters.clear()
    llm = LLM(
        kv_cache_memory=16 * 2**20, max_num_seqs=8, dtype=dtype, kv_cache_dtype=kv_cache_dtype
    )
    runner = llm.engine.runner
    assert runner.model.model.decode_graph is not None
    assert runner.kv_caches[0][0].dtype == kv_cache.cache_dtype(kv_cache_dtype, runner.dtype)
    llm.generate(["warm up"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    sizes = set()
    for batch, prompt_words in ((1, 3), (3, 40), (8, 7), (5, 120)):
        before = len(graph_calls)
        prompts = [" ".join(["word"] * (prompt_words + i)) for i in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        outputs = llm.generate(prompts, params)
        assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)
        assert len(graph_calls) > before
        sizes.update(graph_calls[before:])
    assert {1, 3, 8, 5} <= sizes
    assert not counters["frames"] and not counters["stats"]
