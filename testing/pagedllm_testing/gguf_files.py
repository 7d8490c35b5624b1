"""Small GGUF files for tests, written with the ``gguf`` package as llama.cpp's converter writes
them: llama.cpp's tensor names (from ``gguf``'s own name map), query and key rows permuted for
its rope layout, 2-D weights quantized, and the tokenizer as ``tokenizer.ggml.*`` metadata."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType
from safetensors.numpy import load_file

CONTROL, NORMAL = 3, 1  # llama.cpp's token types


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``permute`` (convert_hf_to_gguf.py) of a query or key projection's rows."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(
    hf_dir: Path,
    path: Path,
    weight_type: GGMLQuantizationType = GGMLQuantizationType.F32,
    tokenizer: bool = True,
    edit_metadata: Callable[[gguf.GGUFWriter], None] | None = None,
) -> Path:
    """Write the Llama checkpoint in ``hf_dir`` (safetensors, byte-level BPE tokenizer) as the
    GGUF file ``path``, its 2-D weights stored as ``weight_type``."""
    config = json.loads((hf_dir / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = config.get("rope_theta") or rope.get("rope_theta", 10000.0)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if tokenizer:
        _add_tokenizer(writer, hf_dir, config)
    if edit_metadata is not None:
        edit_metadata(writer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    for hf_name, tensor in sorted(load_file(hf_dir / "model.safetensors").items()):
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        values = tensor.astype(np.float32)
        if ".attn_q." in name:
            values = llama_cpp_permute(values, heads)
        elif ".attn_k." in name:
            values = llama_cpp_permute(values, kv_heads)
        kind = weight_type if values.ndim == 2 else GGMLQuantizationType.F32
        writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, theta, head_dim))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama3_rope_factors(rope: dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp's converter writes for Llama 3.1's rope scaling."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    factors = []
    for index in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (index / head_dim)
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _add_tokenizer(writer: gguf.GGUFWriter, hf_dir: Path, config: dict[str, Any]) -> None:
    spec = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {added["content"] for added in spec["added_tokens"] if added["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([CONTROL if token in special else NORMAL for token in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_add_bos_token(True)
    tokenizer_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    writer.add_chat_template(tokenizer_config["chat_template"])


def write_tensors(path: Path, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]]) -> Path:
    """A GGUF file of raw tensors (already in their ggml type's bytes) and little else."""
    writer = gguf.GGUFWriter(path, "llama")
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# The float16 fields of each block type (byte offsets), filled with small finite scales by
# ``random_blocks`` so that random blocks decode to finite numbers.
BLOCK_HALVES = {
    GGMLQuantizationType.Q8_0: (0,),
    GGMLQuantizationType.Q4_0: (0,),
    GGMLQuantizationType.Q4_1: (0, 2),
    GGMLQuantizationType.Q5_0: (0,),
    GGMLQuantizationType.Q5_1: (0, 2),
    GGMLQuantizationType.Q2_K: (80, 82),
    GGMLQuantizationType.Q3_K: (108,),
    GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,),
}


def random_blocks(kind: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes of ``rows`` rows of ``kind`` blocks, with small finite f16 scales."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    generator = np.random.default_rng(seed)
    blocks = generator.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    for offset in BLOCK_HALVES[kind]:
        halves = generator.uniform(-0.05, 0.05, len(blocks)).astype(np.float16)
        blocks[:, offset : offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)
