"""The model side of the engine against Hugging Face transformers.

Tiny random checkpoints of each supported architecture are saved with transformers, loaded by
our loader, and run through a paged KV cache (shuffled, non-contiguous blocks; chunked prefill
mixed with decode); every position's logits must match transformers' full forward.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from pagedllm.models import ModelLoadError, cpu_linear
from pagedllm.models.config import read_model_config
from pagedllm.models.layers import LinearRopeScaling, Llama3RopeScaling, PackableLinear
from pagedllm.models.loader import load_model
from pagedllm.models.tokenizer import load_tokenizer
from pagedllm_testing.paged_logits import (
    CASES,
    TINY,
    assert_logits_match,
    hf_logits,
    paged_logits,
    tensor_parallel_worker,
    token_sequences,
)
from pagedllm_testing.serve_harness import free_port
from pagedllm_testing.tiny_models import save_hf_model


@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_prefill_and_decode_match_transformers(tmp_path, case, block_size):
    hf_model = save_hf_model(tmp_path, CASES[case])
    model, _ = load_model(tmp_path)
    tokens = token_sequences()
    assert_logits_match(paged_logits(model, tokens, block_size), hf_logits(hf_model, tokens))


def test_model_config_reflects_each_architecture(tmp_path):
    expectations = {
        "llama-biases": dict(attention_bias=True, attention_output_bias=True, mlp_bias=True),
        "llama-mqa-tied": dict(num_key_value_heads=1, tie_word_embeddings=True),
        "llama-rope-linear": dict(rope_scaling=LinearRopeScaling(factor=2.0)),
        "llama-rope-llama3": dict(
            rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, original_max_position_embeddings=16)
        ),
        "mistral-sliding-window": dict(sliding_window=5, sliding_window_layers=(True, True)),
        "qwen2-bias-tied": dict(
            attention_bias=True, attention_output_bias=False, sliding_window=None
        ),
        "qwen2-sliding-upper-layers": dict(sliding_window=4, sliding_window_layers=(False, True)),
        "qwen3-qk-norm": dict(qk_norm=True, head_dim=32, attention_bias=False),
    }
    architectures = {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }
    for case, expected in expectations.items():
        hf_config = copy.deepcopy(CASES[case])
        hf_config.architectures = [architectures[hf_config.model_type]]
        hf_config.save_pretrained(tmp_path / case)
        config = read_model_config(tmp_path / case)
        assert config.architecture == hf_config.architectures[0]
        assert {key: getattr(config, key) for key in expected} == expected, case


def test_sharded_checkpoint_loads(tmp_path):
    hf_model = save_hf_model(tmp_path, CASES["llama-gqa"], max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    model, _ = load_model(tmp_path)
    tokens = token_sequences()
    assert_logits_match(paged_logits(model, tokens, 4), hf_logits(hf_model, tokens))


def test_dtype_auto_follows_the_checkpoint_and_can_be_overridden(tmp_path):
    save_hf_model(tmp_path, CASES["llama-gqa"])
    config_path = tmp_path / "config.json"
    raw = json.loads(config_path.read_text())
    raw["dtype"] = "bfloat16"
    config_path.write_text(json.dumps(raw))
    model, config = load_model(tmp_path)
    assert config.torch_dtype == "bfloat16"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    model, _ = load_model(tmp_path, dtype="float16")
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    logits = paged_logits(model, token_sequences(), 8)
    assert all(torch.isfinite(seq).all() for seq in logits)


def test_transformers_4_config_layout_and_generation_eos(tmp_path):
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **TINY,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 4.0},
        "eos_token_id": 2,
        "torch_dtype": "float16",
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    config = read_model_config(tmp_path)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == LinearRopeScaling(factor=4.0)
    assert config.eos_token_ids == [2, 7]
    assert config.torch_dtype == "float16"
    assert config.head_dim == 16
    assert config.num_kv_heads_per_rank(2) == 1


def write_config(directory: Path, **overrides) -> None:
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **TINY, **overrides}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw))


def test_config_errors_name_the_problem(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        read_model_config(tmp_path / "absent")
    with pytest.raises(ModelLoadError, match="config.json not found"):
        read_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read .*config.json"):
        read_model_config(tmp_path)
    write_config(tmp_path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        read_model_config(tmp_path)
    write_config(tmp_path, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ModelLoadError, match="'yarn' is not supported"):
        read_model_config(tmp_path)
    write_config(tmp_path, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ModelLoadError, match="low_freq_factor"):
        read_model_config(tmp_path)
    write_config(tmp_path, hidden_size="64")
    with pytest.raises(ModelLoadError, match="'hidden_size' must be a positive integer"):
        read_model_config(tmp_path)
    write_config(tmp_path, num_key_value_heads=3)
    with pytest.raises(ModelLoadError, match="num_key_value_heads=3"):
        read_model_config(tmp_path)
    write_config(tmp_path, vocab_size=None)
    with pytest.raises(ModelLoadError, match="required field 'vocab_size'"):
        read_model_config(tmp_path)


def test_load_errors_name_the_problem(tmp_path):
    save_hf_model(tmp_path, CASES["llama-gqa"])
    with pytest.raises(ModelLoadError, match="auto, float32, float16, bfloat16.*'float8'"):
        load_model(tmp_path, dtype="float8")
    with pytest.raises(ModelLoadError, match="size 3 does not divide num_attention_heads=4"):
        load_model(tmp_path, tp_size=3)

    weights_path = tmp_path / "model.safetensors"
    weights = load_file(weights_path)
    missing = "model.layers.1.mlp.down_proj.weight"
    save_file({k: v for k, v in weights.items() if k != missing}, weights_path)
    with pytest.raises(ModelLoadError, match=f"tensor {missing} is missing"):
        load_model(tmp_path)

    save_file(weights, weights_path)
    write_config(tmp_path, intermediate_size=96)
    with pytest.raises(ModelLoadError, match=r"gate_proj.weight .* shape \[128, 64\].*\[96, 64\]"):
        load_model(tmp_path)

    weights_path.unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors weight files"):
        load_model(tmp_path)

    with pytest.raises(ModelLoadError, match="cannot load a tokenizer"):
        load_tokenizer(tmp_path)


def test_missing_shard_is_named(tmp_path):
    save_hf_model(tmp_path, CASES["llama-gqa"], max_shard_size="40KB")
    shard = sorted(tmp_path.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"weight file .*{shard.name} .* is missing"):
        load_model(tmp_path)


def test_tensor_parallel_ranks_match_a_single_process(tmp_path):
    hf_model = save_hf_model(tmp_path, CASES["llama-biases"])
    expected = hf_logits(hf_model, token_sequences())
    mp.spawn(tensor_parallel_worker, args=(2, free_port(), tmp_path), nprocs=2, join=True)
    for rank in range(2):
        assert_logits_match(torch.load(tmp_path / f"logits-rank{rank}.pt"), expected)


@pytest.mark.skipif(
    not cpu_linear.available(torch.device("cpu"), torch.float32),
    reason="oneDNN weight packing is for x86 CPUs",
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_weights_give_the_logits_of_dense_ones(tmp_path, monkeypatch, dtype):
    save_hf_model(tmp_path, CASES["llama-biases"])
    packed, _ = load_model(tmp_path, dtype=dtype)
    projections = [m for m in packed.modules() if isinstance(m, PackableLinear)]
    assert projections and all(m.packed is not None and m.weight.numel() == 0 for m in projections)
    monkeypatch.setenv(cpu_linear.DISABLE_ENV, "0")
    dense, _ = load_model(tmp_path, dtype=dtype)
    assert all(
        m.packed is None and m.weight.numel() > 0
        for m in dense.modules()
        if isinstance(m, PackableLinear)
    )
    tokens = token_sequences()
    tolerance = 1e-4 if dtype == "float32" else 5e-2
    for ours, theirs in zip(
        paged_logits(packed, tokens, 8), paged_logits(dense, tokens, 8), strict=True
    ):
        assert (ours - theirs).abs().max().item() < tolerance
