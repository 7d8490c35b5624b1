"""The elementwise work of a decoder layer in torch: the contract of the fused CPU kernels
(``csrc/layer_ops_cpu.cpp``, through :mod:`pagedllm.kernels.cpu_ops`), and what the other
backends run.

Numerics follow Hugging Face's Llama family: RMSNorm in float32, the weight multiplied after
rounding to the activations' dtype; the rotary embedding in the activations' dtype, GPT-NeoX
layout (the two halves of a head rotate together).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``: a layer's residual add and the next norm."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated_half * sin[:, None, :]


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` and ``k`` (``[num_tokens, num_heads, head_dim]``) rotated by each token's angles
    (``cos``/``sin``: ``[num_tokens, head_dim]``, the two halves equal)."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x = [gate | up]`` (``[num_tokens, 2 * size]``)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
