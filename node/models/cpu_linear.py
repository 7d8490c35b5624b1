"""Weight matmuls on the CPU through oneDNN, each weight packed once into oneDNN's blocked
layout when the model is loaded (what inductor's CPU backend does with frozen weights).

At decode batches (4-128 rows) this ran the model's matmuls 10-30 % faster than ``F.linear``
on the development machine; at one or two rows SmolLM2's small layers ran slower (a single
stream about 20 % fewer tokens/s in float32). Used on x86 CPUs for
float32 and bfloat16 weights; ``PAGEDLLM_ONEDNN_LINEAR=0`` keeps ``F.linear``.
"""

from __future__ import annotations

import os
import platform

import torch

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


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ([out_features, in_features]) in oneDNN's layout, an opaque tensor."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_BATCH_HINT)


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


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the packed weight, on the bounded row counts above."""
    if x.dim() == 2 and x.shape[0] < ROW_PIECE and padded_rows(x.shape[0]) == x.shape[0]:
        # A row count run as it is, one call: the pieces' slicing and joining cost 20 us a
        # call in Python, some 2.5 ms a decode step of SmolLM2's 121 matmuls.
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
