"""Building blocks of the decoder models, sharded for tensor parallelism.

Numerics follow Hugging Face's Llama family (norms in float32, rotary tables in float32 cast to
the activations' dtype), so that a checkpoint gives the same logits here as there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.backend import KernelOps
from pagedllm.lora.layers import LoRALinear
from pagedllm.models import cpu_linear, quantized
from pagedllm.models.quantized import QuantizedWeight


class RMSNorm(nn.Module):
    """RMSNorm through the kernel backend's ops; given the residual stream, it adds ``x`` to it
    first and returns ``(normed, residual)`` (one pass where the backend fuses them)."""

    def __init__(self, size: int, eps: float, ops: KernelOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


@dataclass(frozen=True)
class LinearRopeScaling:
    """Position interpolation: every frequency divided by ``factor``."""

    factor: float

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        return inv_freq / self.factor


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's scaling: long wavelengths divided by ``factor``, short ones kept, and the
    band between them interpolated smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        old_context = self.original_max_position_embeddings
        low_freq_wavelen = old_context / self.low_freq_factor
        high_freq_wavelen = old_context / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_context / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)


@dataclass(frozen=True)
class FrequencyFactorRopeScaling:
    """Each frequency divided by its own factor: how llama.cpp stores Llama 3.1's scaling in a
    GGUF file (the ``rope_freqs`` tensor, computed from the ``llama3`` parameters)."""

    factors: tuple[float, ...]

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        return inv_freq / torch.tensor(self.factors, dtype=inv_freq.dtype)


RopeScaling = LinearRopeScaling | Llama3RopeScaling | FrequencyFactorRopeScaling


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, GPT-NeoX layout (the two halves of a head rotate together)."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        self.register_buffer(
            "inv_freq", torch.empty(head_dim // 2, dtype=torch.float32), persistent=False
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Fill ``inv_freq``; to be called again after materializing a model built on ``meta``."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        inv_freq = 1.0 / (self.theta**exponents)
        if self.scaling is not None:
            inv_freq = self.scaling.apply(inv_freq)
        with torch.no_grad():
            self.inv_freq.copy_(inv_freq)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``(cos, sin)``, each ``[num_tokens, head_dim]`` in ``dtype``."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


class PackableLinear(nn.Linear):
    """A linear layer whose weight can be packed for MKL or oneDNN once loaded (``cpu_linear``), or
    kept quantized (``quantized``); LoRA adapters' products are added to its output
    (``lora``, set by a worker serving adapters)."""

    packed: cpu_linear.PackedWeight | None = None
    quantized: QuantizedWeight | None = None
    quant_ops: KernelOps | None = None
    lora: LoRALinear | None = None

    def pack_weight(self) -> None:
        """Keep the weight only in its packed layout (the dense copy is freed)."""
        self.packed = cpu_linear.pack(self.weight)
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def set_quantized(self, weight: QuantizedWeight, ops: KernelOps) -> None:
        """Multiply by ``weight`` through ``ops.quant_linear`` (the dense weight is freed)."""
        if weight.shape != (self.out_features, self.in_features):
            raise ValueError(
                f"quantized weight of shape {list(weight.shape)} for a linear layer of "
                f"{self.in_features} -> {self.out_features} features"
            )
        self.quantized, self.quant_ops = weight, ops
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quantized is not None:
            assert self.quant_ops is not None
            w = self.quantized
            out = self.quant_ops.quant_linear(x, w.qweight, w.scales, w.mins, w.bits, w.group_size)
            return out if bias is None else out + bias
        if self.packed is not None:
            return cpu_linear.linear(x, self.packed, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, self.bias)
        return out if self.lora is None else self.lora.add(x, out)


class VocabEmbedding(nn.Embedding):
    """The token embedding, its table dense or kept quantized (``quantized``: rows are
    de-quantized as they are looked up)."""

    quantized: QuantizedWeight | None = None

    def set_quantized(self, weight: QuantizedWeight) -> None:
        self.quantized = weight
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return quantized.lookup(self.quantized, ids, self.weight.dtype)
        return super().forward(ids)


class ColumnParallelLinear(PackableLinear):
    """A linear layer whose output features are split across ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_size: int) -> None:
        super().__init__(in_features, out_features // tp_size, bias=bias)


class RowParallelLinear(PackableLinear):
    """A linear layer whose input features are split across ranks; partial sums are
    all-reduced, and the (replicated) bias is added once, after the reduction."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_size: int) -> None:
        super().__init__(in_features // tp_size, out_features, bias=bias)
        self.tp_size = tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        out = self.matmul(x, None)
        dist.all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one projection."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool, tp_size: int, ops: KernelOps
    ) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_proj = ColumnParallelLinear(
            hidden_size, 2 * intermediate_size, bias=bias, tp_size=tp_size
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=bias, tp_size=tp_size
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))
