"""The weights of a GGUF file, read under their Hugging Face names, de-quantized or kept
quantized (``pagedllm.models.quantized``).

The loader asks for ``model.layers.3.self_attn.q_proj.weight``; this reads ``blk.3.attn_q.weight``,
de-quantizes it with the ``gguf`` package (to float32; the loader casts to ``--dtype``) and
undoes the row permutation llama.cpp's converter applies to the query and key projections
(it interleaves the two rotary halves of each head, for its own rope layout).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.models import ModelLoadError
from pagedllm.models.config import ModelConfig
from pagedllm.models.gguf import GGUFFile
from pagedllm.models.quantized import QuantizedWeight, from_gguf_blocks

if TYPE_CHECKING:
    from pagedllm.models.gguf_reader import TensorInfo

# Hugging Face Llama names -> llama.cpp's (``{i}`` is the layer).
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_LAYER_PARAM = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def gguf_tensor_name(hf_name: str) -> str:
    """llama.cpp's name of the Hugging Face Llama tensor ``hf_name``."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    match = _LAYER_PARAM.match(hf_name)
    if match is None or match[2] not in _LAYER_NAMES:
        raise ModelLoadError(f"no GGUF tensor corresponds to parameter {hf_name}")
    return f"blk.{match[1]}.{_LAYER_NAMES[match[2]]}.{match[3]}"


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` of a q/k projection's rows (or bias): per head, rows
    ``[h0, h1, ...]`` stored as pairs ``(h0[0], h1[0]), (h0[1], h1[1]) ...`` go back to the two
    halves ``h0``, ``h1`` (transformers' ``LlamaTensorProcessor`` does the same)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
    )


@dataclass
class _Dense:
    """A de-quantized tensor behind the loader's lazy-slice interface (``get_shape``, ``[...]``)."""

    tensor: torch.Tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: object) -> torch.Tensor:
        return self.tensor[index]  # type: ignore[index]


class GGUFCheckpoint:
    """A GGUF file opened for reading by Hugging Face tensor name (the loader's checkpoint)."""

    def __init__(self, config: ModelConfig) -> None:
        assert config.gguf_file is not None
        self.path: Path = config.gguf_file
        self.config = config
        self.file = GGUFFile.open(self.path)
        self.file.check_tensor_types()
        self._tensors = dict(self.file.contents.tensors)

    def __enter__(self) -> GGUFCheckpoint:
        return self

    def __exit__(self, *exc_info: object) -> None:
        # The reader's memory map goes with it.
        self._tensors.clear()

    def file_of(self, name: str) -> Path:
        return self.path

    def _tensor(self, name: str) -> TensorInfo:
        gguf_name = gguf_tensor_name(name)
        tensor = self._tensors.get(gguf_name)
        if tensor is None:
            raise ModelLoadError(f"tensor {gguf_name} (for {name}) is missing from {self.path}")
        return tensor

    def _rotary_heads(self, name: str) -> int | None:
        """The heads whose rows llama.cpp permuted in tensor ``name`` (q and k), else None."""
        if ".q_proj." in name:
            return self.config.num_attention_heads
        if ".k_proj." in name:
            return self.config.num_key_value_heads
        return None

    def tensor_type(self, name: str) -> str:
        """The ggml type name of the tensor read for ``name``."""
        return self._tensor(name).type.name

    def slice(self, name: str) -> _Dense:
        values = torch.from_numpy(dequantize(self._tensor(name)))
        heads = self._rotary_heads(name)
        if heads is not None:
            values = unpermute_rotary_rows(values, heads)
        return _Dense(values)

    def quantized(self, name: str) -> QuantizedWeight:
        """The 2-D tensor read for ``name``, kept quantized (its type one of
        ``KEPT_GGUF_TYPES``)."""
        tensor = self._tensor(name)
        if len(tensor.shape) != 2:
            raise ModelLoadError(f"tensor {tensor.name} has shape {list(tensor.shape)}, not 2-D")
        rows, cols = tensor.shape
        weight = from_gguf_blocks(tensor.type.name, tensor.data, rows, cols)
        heads = self._rotary_heads(name)
        if heads is not None:
            weight = weight.rows(unpermute_rotary_rows(torch.arange(rows), heads))
        return weight


def dequantize(tensor: TensorInfo) -> np.ndarray:
    """A GGUF tensor's values as float32, in row-major (torch) order."""
    from gguf import quants

    try:
        values = quants.dequantize(tensor.data, tensor.type)
    except (NotImplementedError, ValueError) as error:
        raise ModelLoadError(
            f"cannot de-quantize tensor {tensor.name} ({tensor.type.name}): {error}"
        ) from error
    values = values.astype(np.float32, copy=False)
    # F32 tensors come back as views of the read-only memory map.
    return values if values.flags.writeable else values.copy()
