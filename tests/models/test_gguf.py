"""GGUF files as a model source: config from metadata, weights de-quantized and un-permuted,
every claimed tensor type checked, and the errors a bad file gets.

The files are written here with the ``gguf`` package (``pagedllm_testing.gguf_files``) from small
Hugging Face checkpoints, so each GGUF-loaded parameter has a known answer.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil

import gguf
import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from gguf import GGMLQuantizationType as Q
from gguf import quants
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.integrations.gguf import dequant as hf_dequant

from pagedllm.kernels import reference
from pagedllm.models import ModelLoadError, cpu_linear, loader
from pagedllm.models.config import read_model_config
from pagedllm.models.gguf import SUPPORTED_TENSOR_TYPES, GGUFFile, find_gguf_file
from pagedllm.models.gguf_weights import dequantize, unpermute_rotary_rows
from pagedllm.models.layers import FrequencyFactorRopeScaling, PackableLinear, VocabEmbedding
from pagedllm.models.loader import load_model
from pagedllm.models.quantized import quantize_int8, resident_weight_bytes
from pagedllm_testing.gguf_files import llama_cpp_permute, random_blocks, write_gguf, write_tensors
from pagedllm_testing.paged_logits import (
    CASES,
    assert_logits_match,
    hf_logits,
    paged_logits,
    tensor_parallel_worker,
    token_sequences,
)
from pagedllm_testing.serve_harness import free_port
from pagedllm_testing.tiny_models import save_engine_model, save_hf_model

# Four query heads over two KV heads, an untied head (output.weight), a vocabulary the demo
# tokenizer's ids fit in.
TINY = LlamaConfig(
    vocab_size=2048,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=50000.0,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)
# Quantizing types gguf can write: the largest error of a de-quantized weight, relative to the
# largest magnitude in its row (a wrong decoding is off by the whole value).
K_QUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
ROUND_TRIP_TYPES = {
    Q.F16: 1e-3,
    Q.BF16: 1e-2,
    Q.Q8_0: 1e-2,
    Q.Q5_0: 0.07,
    Q.Q5_1: 0.07,
    Q.Q4_0: 0.15,
    Q.Q4_1: 0.15,
}


@pytest.fixture(autouse=True)
def dense_weights(monkeypatch):
    # Packed (oneDNN) projections hide their weights; these tests read them back.
    monkeypatch.setenv(cpu_linear.DISABLE_ENV, "0")


@pytest.fixture
def tiny_dir(tmp_path):
    directory = tmp_path / "hf"
    save_engine_model(directory, TINY)
    return directory


def parameters(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_config_comes_from_the_metadata(tiny_dir, tmp_path):
    path = write_gguf(tiny_dir, tmp_path / "tiny.gguf", Q.Q8_0)
    ours, reference = read_model_config(path), read_model_config(tiny_dir)
    assert ours.gguf_file == path and reference.gguf_file is None
    differing = {
        field.name
        for field in dataclasses.fields(ours)
        if getattr(ours, field.name) != getattr(reference, field.name)
    }
    # Layers, heads, KV heads, rope theta, vocabulary, context, untied head, biases, BOS/EOS
    # all agree; GGUF keeps the norm epsilon in float32; a quantized file names no float type
    # (auto serves it in float32).
    assert differing == {"model_dir", "gguf_file", "torch_dtype", "rms_norm_eps"}
    assert ours.rms_norm_eps == float(np.float32(reference.rms_norm_eps))
    assert ours.torch_dtype is None
    assert not ours.tie_word_embeddings and ours.rope_theta == 50000.0


def test_tied_embeddings_follow_the_missing_output_tensor(tmp_path):
    from pagedllm.models.demo import demo_model_dir

    path = write_gguf(demo_model_dir(), tmp_path / "demo.gguf")
    config = read_model_config(path)
    assert config.tie_word_embeddings and config.torch_dtype == "float32"
    assert config.num_key_value_heads == 2 and config.num_attention_heads == 4


def test_float32_file_loads_the_exact_weights(tiny_dir, tmp_path):
    path = write_gguf(tiny_dir, tmp_path / "tiny.gguf")
    ours, _ = load_model(path, dtype="float32")
    reference, _ = load_model(tiny_dir, dtype="float32")
    expected = parameters(reference)
    loaded = parameters(ours)
    assert loaded.keys() == expected.keys()
    for name, value in loaded.items():
        assert torch.equal(value, expected[name]), name


def test_llama3_rope_scaling_comes_as_frequency_factors(tmp_path):
    hf_model = save_hf_model(tmp_path / "hf", CASES["llama-rope-llama3"])
    path = write_gguf(tmp_path / "hf", tmp_path / "llama3.gguf", tokenizer=False)
    config = read_model_config(path)
    assert isinstance(config.rope_scaling, FrequencyFactorRopeScaling)
    ours, _ = load_model(path, dtype="float32")
    tokens = token_sequences()
    assert_logits_match(paged_logits(ours, tokens, 8), hf_logits(hf_model, tokens))


def test_unpermute_inverts_llama_cpp_permute():
    rows = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    for heads in (1, 3):
        permuted = torch.from_numpy(llama_cpp_permute(rows, heads))
        assert not torch.equal(permuted, torch.from_numpy(rows))
        assert torch.equal(unpermute_rotary_rows(permuted, heads), torch.from_numpy(rows))


@pytest.mark.parametrize("kind", sorted(ROUND_TRIP_TYPES, key=lambda k: k.name))
def test_quantized_file_loads_the_dequantized_weights(tiny_dir, tmp_path, kind):
    path = write_gguf(tiny_dir, tmp_path / "tiny.gguf", kind)
    ours, _ = load_model(path, dtype="float32", quantization="none")
    reference, _ = load_model(tiny_dir, dtype="float32")
    originals = parameters(reference)
    for name, value in parameters(ours).items():
        original = originals[name]
        if value.dim() == 1:  # norms stay F32
            assert torch.equal(value, original), name
            continue
        # Quantization works on row blocks, so it commutes with the row permutation: the
        # loaded weight is exactly gguf's round trip of the original.
        expected = quants.dequantize(quants.quantize(original.numpy(), kind), kind)
        assert torch.equal(value, torch.from_numpy(expected)), name
        scale = original.abs().amax(dim=1, keepdim=True)
        assert ((value - original).abs() / scale).max() < ROUND_TRIP_TYPES[kind], name


def test_quantized_file_matches_transformers_reading_it(tiny_dir, tmp_path):
    path = write_gguf(tiny_dir, tmp_path / "tiny.gguf", Q.Q4_1)
    ours, _ = load_model(path, dtype="float32", quantization="none")
    theirs = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    tokens = token_sequences()
    assert_logits_match(paged_logits(ours, tokens, 8), hf_logits(theirs, tokens))


@pytest.mark.parametrize("kind", K_QUANTS, ids=lambda k: k.name)
def test_k_quants_decode_like_transformers(tmp_path, kind):
    """gguf cannot write K-quants, so random blocks go into the file and the values read back
    must equal transformers' own (torch) decoder of the same bytes."""
    data = random_blocks(kind, rows=6, cols=512)
    path = write_tensors(tmp_path / "k.gguf", {"blk.0.ffn_up.weight": (data, kind)})
    tensor = GGUFFile.open(path).contents.tensors["blk.0.ffn_up.weight"]
    assert tensor.shape == (6, 512) and tensor.type == kind
    ours = dequantize(tensor)
    theirs = hf_dequant.dequantize(torch.from_numpy(data.copy()).reshape(-1), int(kind))
    assert np.isfinite(ours).all() and np.abs(ours).max() > 0
    np.testing.assert_allclose(ours, theirs.reshape(6, 512).numpy(), rtol=1e-6, atol=1e-6)


def test_every_claimed_type_is_checked_here():
    checked = {kind.name for kind in (*ROUND_TRIP_TYPES, *K_QUANTS)} | {"F32"}
    assert checked == set(SUPPORTED_TENSOR_TYPES)


def test_an_unsupported_tensor_type_is_named(tmp_path):
    data = np.zeros((2, 18), dtype=np.uint8)  # two rows of one IQ4_NL block each
    path = write_tensors(tmp_path / "iq.gguf", {"blk.0.attn_q.weight": (data, Q.IQ4_NL)})
    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_q\.weight is stored as IQ4_NL"):
        read_model_config(path)


def test_an_unsupported_architecture_is_named(tiny_dir, tmp_path):
    path = write_gguf(
        tiny_dir,
        tmp_path / "tiny.gguf",
        edit_metadata=lambda w: w.add_string("general.architecture", "mamba"),
    )
    with pytest.raises(ModelLoadError, match="architecture 'mamba' is not supported"):
        read_model_config(path)


def test_an_unsupported_rope_scaling_is_named(tiny_dir, tmp_path):
    path = write_gguf(
        tiny_dir,
        tmp_path / "tiny.gguf",
        edit_metadata=lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN),
    )
    with pytest.raises(ModelLoadError, match="rope scaling type 'yarn'"):
        read_model_config(path)


def test_a_directory_holding_one_gguf_file_is_a_model(tiny_dir, tmp_path):
    directory = tmp_path / "gguf-dir"
    directory.mkdir()
    path = write_gguf(tiny_dir, directory / "model.gguf", Q.Q8_0)
    assert find_gguf_file(directory) == path
    assert read_model_config(directory).gguf_file == path
    assert find_gguf_file(tiny_dir) is None  # a Hugging Face directory stays one


def test_a_directory_holding_several_gguf_files_asks_for_one(tiny_dir, tmp_path):
    directory = tmp_path / "gguf-dir"
    directory.mkdir()
    path = write_gguf(tiny_dir, directory / "model-Q8_0.gguf", Q.Q8_0)
    shutil.copy(path, directory / "model-Q4_0.gguf")
    with pytest.raises(ModelLoadError, match="holds 2 GGUF files .* pass the one to serve"):
        read_model_config(directory)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "cannot read GGUF file"),
        (b"NOTGGUF-at-all", "not a GGUF file"),
        (b"GGUF\x07\x00\x00\x00", "GGUF version 7"),
        (b"GGUF\x03\x00\x00\x00\x01\x00", "truncated"),
    ],
)
def test_a_broken_file_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match=message):
        read_model_config(path)


def test_a_truncated_tensor_is_a_clear_error(tiny_dir, tmp_path):
    path = write_gguf(tiny_dir, tmp_path / "tiny.gguf", Q.Q8_0)
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match="runs past the end of the file"):
        read_model_config(path)


# Resident bytes of a kept file over the file's: Q8_0 and Q4_1 as they are; Q4_0 gains a
# float16 minimum (-8 x its scale) per 32 values, Q5_0 and Q5_1 hold 5-bit values in bytes.
KEPT_SIZE = {Q.Q8_0: 1.02, Q.Q4_1: 1.02, Q.Q4_0: 1.15, Q.Q5_0: 1.6, Q.Q5_1: 1.6}


def linear_weights(model) -> dict[str, torch.Tensor]:
    """Every linear layer's and the embedding's weight, de-quantized where kept quantized."""
    weights = {}
    for name, module in model.named_modules():
        if isinstance(module, (PackableLinear, VocabEmbedding)):
            held = module.quantized
            weights[name] = held.dequantize(torch.float32) if held else module.weight.detach()
    return weights


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1], ids=lambda k: k.name)
def test_quantized_tensors_are_kept_quantized_with_the_same_values(tiny_dir, tmp_path, kind):
    path = write_gguf(tiny_dir, tmp_path / "tiny.gguf", kind)
    kept, _ = load_model(path, dtype="float32")
    dense, _ = load_model(path, dtype="float32", quantization="none")
    held = [m for m in kept.modules() if isinstance(m, PackableLinear)]
    assert held and all(m.quantized is not None and m.weight.numel() == 0 for m in held)
    assert kept.model.embed_tokens.quantized is not None
    expected = linear_weights(dense)
    for name, weight in linear_weights(kept).items():
        assert torch.equal(weight, expected[name]), name
    # The file's quantized tensors in about their own bytes, instead of four per weight.
    file_bytes = sum(t.data.nbytes for t in GGUFFile.open(path).contents.tensors.values())
    resident = resident_weight_bytes(kept)
    assert resident <= KEPT_SIZE[kind] * file_bytes < resident_weight_bytes(dense)
    tokens = token_sequences()
    for ours, theirs in zip(
        paged_logits(kept, tokens, 8), paged_logits(dense, tokens, 8), strict=True
    ):
        assert (ours - theirs).abs().max() < 0.05 * theirs.abs().max()


def test_a_tied_quantized_embedding_is_held_once(tmp_path):
    from pagedllm.models.demo import demo_model_dir

    path = write_gguf(demo_model_dir(), tmp_path / "demo.gguf", Q.Q8_0)
    model, config = load_model(path, dtype="float32")
    assert config.tie_word_embeddings
    assert model.lm_head.quantized is model.model.embed_tokens.quantized is not None


def test_a_type_the_kernels_cannot_take(tiny_dir, tmp_path, monkeypatch, caplog):
    path = write_gguf(tiny_dir, tmp_path / "tiny.gguf", Q.Q8_0)
    # As if the kernels took no Q8_0: what a Q2_K or Q3_K file meets.
    monkeypatch.setattr(loader, "KEPT_GGUF_TYPES", ("Q4_0",))
    with pytest.raises(ModelLoadError, match=r"--quantization gguf: tensor .* stored as Q8_0"):
        load_model(path, dtype="float32", quantization="gguf")
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        model, _ = load_model(path, dtype="float32")
    assert "GGUF tensors of type Q8_0 are de-quantized at load" in caplog.text
    assert all(getattr(m, "quantized", None) is None for m in model.modules())


def test_gguf_quantization_needs_a_gguf_file(tiny_dir):
    with pytest.raises(ModelLoadError, match="is not a GGUF model"):
        load_model(tiny_dir, quantization="gguf")
    with pytest.raises(ModelLoadError, match="quantization must be one of"):
        load_model(tiny_dir, quantization="fp8")


# Two layers of the benchmark model's shape (bench/common.py), tied embeddings.
BENCH_LAYERS = LlamaConfig(
    **{
        **TINY.to_dict(),
        **dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12),
        **dict(num_key_value_heads=4, head_dim=64, tie_word_embeddings=True),
    }
)


# Bounds per model: the largest error as a share of the largest logit, and the share of
# positions whose argmax agrees (random weights at the benchmark's width spread the rows'
# rounding further).
@pytest.mark.parametrize(
    "config,largest_error,agreement",
    [(TINY, 0.05, 0.9), (BENCH_LAYERS, 0.1, 0.8)],
    ids=["tiny", "benchmark-layers"],
)
def test_int8_matches_a_model_with_the_same_dequantized_weights(
    config, largest_error, agreement, tmp_path
):
    save_engine_model(tmp_path, config)
    quantized, _ = load_model(tmp_path, dtype="float32", quantization="int8")
    reference, _ = load_model(tmp_path, dtype="float32")
    linears = [m for m in quantized.modules() if isinstance(m, PackableLinear)]
    assert linears and all(m.quantized is not None for m in linears)
    with torch.no_grad():
        for name, module in reference.named_modules():
            if isinstance(module, PackableLinear):
                dense = quantize_int8(module.weight).dequantize(torch.float32)
                module.weight.copy_(dense)
                assert torch.equal(
                    dense, quantized.get_submodule(name).quantized.dequantize(torch.float32)
                )
    tokens = token_sequences()
    for ours, theirs in zip(
        paged_logits(quantized, tokens, 8), paged_logits(reference, tokens, 8), strict=True
    ):
        # The weights are the same: what differs is the rows' rounding to int8 groups in the
        # kernel (a few percent of the logits on random weights; SmolLM2's quality is
        # bench/quantized.py's).
        assert (ours - theirs).abs().max() < largest_error * theirs.abs().max()
        assert (ours - theirs).norm() < 0.06 * theirs.norm()
        assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > agreement


def test_tensor_parallel_ranks_split_quantized_weights_on_group_boundaries(tmp_path):
    save_hf_model(tmp_path / "hf", CASES["llama-gqa"])
    path = write_gguf(tmp_path / "hf", tmp_path / "tiny.gguf", Q.Q4_1, tokenizer=False)
    single, _ = load_model(path, ops=reference)
    assert single.model.layers[0].mlp.down_proj.quantized is not None
    expected = paged_logits(single, token_sequences(), 4)
    mp.spawn(tensor_parallel_worker, args=(2, free_port(), tmp_path, path), nprocs=2, join=True)
    for rank in range(2):
        assert_logits_match(torch.load(tmp_path / f"logits-rank{rank}.pt"), expected)


def test_on_cuda_quantized_weights_are_dequantized_at_load(tiny_dir, tmp_path):
    path = write_gguf(tiny_dir, tmp_path / "tiny.gguf", Q.Q8_0)
    config = read_model_config(path)
    cuda = torch.device("cuda")
    # The quantized kernels are the CPU's: on a GPU every scheme serves the dtype's weights.
    assert loader.resolve_quantization(None, config, torch.device("cpu")) == "gguf"
    assert loader.resolve_quantization(None, config, cuda) == "none"
    assert loader.resolve_quantization("int8", config, cuda) == "none"
    assert loader.resolve_quantization(None, read_model_config(tiny_dir), cuda) == "none"
