"""Weight matmuls on the CPU through a packed layout, each weight packed once when the model
is loaded (what inductor's CPU backend does with frozen weights): float32 and bfloat16 weights
in panels of 16 output features for the C++ panel matmul where the kernels are built for
AVX-512 (``csrc/panel_linear_cpu.cpp``); else float32 ones in MKL's packed sgemm layout, and
bfloat16 ones (and float32 where MKL is missing) in oneDNN's blocked layout. Used on x86 CPUs;
``PAGEDLLM_ONEDNN_LINEAR=0`` keeps ``F.linear``.

The order is the measured one (the tables: ``docs/design/kernels.md``): in float32 MKL's packed
sgemm beats oneDNN and ``F.linear`` at every decode row count, and the panels beat MKL at the
row counts decode steps run; a prompt of hundreds of tokens costs a little more in its
matmuls through the panels.

MKL's packed layout does not depend on the row count it is packed for (its size is the same
for 1 and 32 rows, and products of every row count match ``F.linear``): one copy serves every
batch. torch's op falls back to ``F.linear`` over the original weight unless the row count is
the one packed for, so each call names its own row count and gives a stand-in of the original
weight's shape that holds no memory; a first product per weight shape is checked against
``F.linear`` at load, and a disagreeing one keeps oneDNN.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu_extension

DISABLE_ENV = "PAGEDLLM_ONEDNN_LINEAR"  # "0" turns packing off
# The batch oneDNN picks its layout for; decode batches are around it.
PACK_BATCH_HINT = 64
# oneDNN (and ideep above it) keep a primitive, with its JIT code and scratchpad, for every
# input shape they see, up to 1,024 of each: about 0.6 MB per (weight shape, row count). A
# server sees every row count up to its token budget, so matmuls run on a bounded set of row
# counts: whole multiples of ROW_PIECE in one call, the rest padded up to the next of a few
# sizes per power of two (exact up to EXACT_ROWS rows), which wastes less than an eighth of
# the rows: beyond a few dozen rows these matmuls are bound by compute, and the padding costs
# what it computes.
ROW_PIECE = 256
EXACT_ROWS = 8
# Even bucketed, a server meets about 55 row counts per weight shape; cached for ever (1,024 by
# default) their primitives would add a model's 4 shapes x 55 x 0.55 MB, some 120 MB, to the
# worker, one new row count at a time over hours of traffic. Both caches (oneDNN's primitive
# cache and ideep's above it, each about half of that size) keep the most recently used
# CACHED_PRIMITIVES instead: a step needs at most two row counts per shape, and a primitive
# evicted and needed again is rebuilt in about a millisecond.
CACHED_PRIMITIVES = 64
CACHE_CAPACITY_ENVS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        os.environ.get(DISABLE_ENV) != "0"
        and device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and platform.machine() in ("x86_64", "AMD64")
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def bound_caches() -> None:
    """Cap oneDNN's and ideep's primitive caches at ``CACHED_PRIMITIVES`` each, unless the
    environment sets them. Both read their capacity once, when the process first builds a
    primitive: call this before."""
    for name in CACHE_CAPACITY_ENVS:
        os.environ.setdefault(name, str(CACHED_PRIMITIVES))


@dataclass(frozen=True)
class PackedWeight:
    """A weight in the panels of the C++ matmul (``panels``), or in MKL's or oneDNN's packed
    layout (``data``, an opaque tensor). ``stand_in`` (MKL's only) has the original weight's
    shape and one element of storage: what MKL's op reads of the original weight is its
    shape."""

    data: torch.Tensor
    out_features: int
    in_features: int
    stand_in: torch.Tensor | None
    panels: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of the packed values (the opaque tensors do not say: MKL reserves more
        address space than it fills)."""
        if self.stand_in is not None:
            return self.out_features * self.in_features * self.stand_in.element_size()
        return self.data.numel() * self.data.element_size()


# (out_features, in_features) -> whether MKL's packed products matched F.linear there.
_mkl_checked: dict[tuple[int, int], bool] = {}
CHECK_ROWS = (1, 5, 33)


def _mkl_available(weight: torch.Tensor) -> bool:
    return (
        weight.dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
        and hasattr(torch.ops.mkl, "_mkl_linear")
    )


def _mkl_pack(weight: torch.Tensor) -> PackedWeight:
    out_features, in_features = weight.shape
    data = torch.ops.mkl._mkl_reorder_linear_weight(weight, PACK_BATCH_HINT)
    stand_in = weight.new_zeros(1).expand(out_features, in_features)
    return PackedWeight(data, out_features, in_features, stand_in)


def _mkl_agrees(weight: torch.Tensor, packed: PackedWeight) -> bool:
    """Whether MKL's products of ``packed`` equal ``F.linear``'s at a few row counts."""
    generator = torch.Generator().manual_seed(0)
    for rows in CHECK_ROWS:
        x = torch.randn(rows, weight.shape[1], generator=generator)
        want = F.linear(x, weight)
        scale = float(want.abs().max()) + 1.0
        if not torch.allclose(linear(x, packed, None), want, rtol=1e-4, atol=1e-4 * scale):
            return False
    return True


def _panels_available(weight: torch.Tensor) -> bool:
    return (
        (
            weight.dtype == torch.float32
            or (weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0)
        )
        and cpu_extension.has_avx512()
        and cpu_extension.load()
    )


def pack(weight: torch.Tensor) -> PackedWeight:
    """``weight`` ([out_features, in_features]) in panels (float32 and bfloat16 on AVX-512
    CPUs), MKL's layout (float32, where MKL's products check out for its shape) or oneDNN's."""
    weight = weight.detach().contiguous()
    if _panels_available(weight):
        data = torch.ops.pagedllm_cpu.pack_linear_weight(weight)
        return PackedWeight(data, weight.shape[0], weight.shape[1], None, panels=True)
    if _mkl_available(weight):
        packed = _mkl_pack(weight)
        shape = tuple(weight.shape)
        if shape not in _mkl_checked:
            _mkl_checked[shape] = _mkl_agrees(weight, packed)
        if _mkl_checked[shape]:
            return packed
    data = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
    return PackedWeight(data, weight.shape[0], weight.shape[1], None)


def padded_rows(rows: int) -> int:
    """The row count a matmul of ``rows`` rows (fewer than ``ROW_PIECE``) runs on: eight sizes
    per power of two."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 4)  # an eighth of the power of two at or below rows
    return -(-rows // step) * step


def row_pieces(rows: int) -> list[tuple[int, int]]:
    """``(rows taken, rows computed)`` for each matmul call over ``rows`` input rows."""
    whole, rest = divmod(rows, ROW_PIECE)
    pieces = [(whole * ROW_PIECE, whole * ROW_PIECE)] if whole else []
    if rest:
        pieces.append((rest, padded_rows(rest)))
    return pieces


def linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the packed weight; through oneDNN, on the bounded
    row counts above (MKL and the panels keep nothing per row count)."""
    if weight.panels:
        return torch.ops.pagedllm_cpu.panel_linear(x, weight.data, weight.out_features, bias)
    if weight.stand_in is not None:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return torch.ops.mkl._mkl_linear(x.contiguous(), weight.data, weight.stand_in, bias, rows)
    packed = weight.data
    if x.dim() == 2 and x.shape[0] < ROW_PIECE and padded_rows(x.shape[0]) == x.shape[0]:
        # A row count run as it is, one call: the pieces' slicing and joining cost a fixed
        # time a call in Python, paid by every matmul of a decode step.
        return torch.ops.mkldnn._linear_pointwise.default(x, packed, bias, "none", [], "")
    rows = x.reshape(-1, x.shape[-1])
    outputs, start = [], 0
    for taken, computed in row_pieces(rows.shape[0]):
        piece = rows[start : start + taken]
        if computed > taken:
            piece = torch.nn.functional.pad(piece, (0, 0, 0, computed - taken))
        out = torch.ops.mkldnn._linear_pointwise(piece, packed, bias, "none", [], "")
        outputs.append(out[:taken])
        start += taken
    if not outputs:  # no rows: nothing to bound
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    return out.reshape(*x.shape[:-1], out.shape[-1])
