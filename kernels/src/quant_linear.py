"""Weight-only quantized matmuls in torch: the contract of the CPU kernel
(``csrc/quant_linear_cpu.cpp``, through :mod:`pagedllm.kernels.cpu_ops`), and what the other
backends run.

A quantized weight ``W`` ([out_features, in_features]) is kept as groups of ``group_size``
consecutive input features along each row, ``W[n, k] = scales[n, g] * q[n, k] + mins[n, g]``
with ``g = k // group_size`` (no ``mins``: 0), the integers ``q`` stored as
- ``bits=8``: ``qweight`` int8 ``[N, K]``, one value a byte (group size 16 or 32);
- ``bits=4``: ``qweight`` uint8 ``[N, K / 2]``, each group of 32 values in 16 bytes, byte ``i``
  holding value ``i`` in its low nibble and value ``i + 16`` in its high one (GGUF's Q4_0 and
  Q4_1 order, so that those blocks are kept as they are);
and ``scales``/``mins`` float16 ``[N, K / group_size]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BITS = (4, 8)
GROUP_SIZES = (16, 32)
NIBBLE_GROUP = 32  # the group of the 4-bit layout (two halves of 16 bytes)


def unpack(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """The integers of ``qweight`` as int16 ``[N, K]`` (uint8 nibbles widened, int8 as is)."""
    if bits == 8:
        return qweight.to(torch.int16)
    rows = qweight.shape[0]
    halves = qweight.reshape(rows, -1, NIBBLE_GROUP // 2)
    low, high = halves & 15, halves >> 4
    return torch.cat((low, high), dim=-1).reshape(rows, -1).to(torch.int16)


def dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bits: int,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The weight ``[N, K]`` in ``dtype``, computed in float32."""
    values = unpack(qweight, bits).float()
    rows = values.shape[0]
    groups = values.reshape(rows, -1, group_size) * scales.float()[..., None]
    if mins is not None:
        groups = groups + mins.float()[..., None]
    return groups.reshape(rows, -1).to(dtype)


def quant_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """``x @ W.T`` (``x``: ``[rows, K]``), in ``x``'s dtype."""
    weight = dequantize(qweight, scales, mins, bits, group_size, torch.float32)
    return F.linear(x.float(), weight).to(x.dtype)
