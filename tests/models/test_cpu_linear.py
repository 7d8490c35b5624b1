"""oneDNN-packed matmuls: the same numbers as ``F.linear``, on a bounded set of row counts
(oneDNN keeps a primitive per input shape it sees, so unbounded shapes grow the worker)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.models import cpu_linear

pytestmark = pytest.mark.skipif(
    not cpu_linear.available(torch.device("cpu"), torch.float32),
    reason="oneDNN weight packing is for x86 CPUs",
)


def test_row_pieces_cover_every_row_once_on_a_bounded_set_of_shapes():
    budget = 8192
    shapes = set()
    for rows in range(1, budget + 1):
        pieces = cpu_linear.row_pieces(rows)
        assert sum(taken for taken, _ in pieces) == rows
        assert all(computed >= taken for taken, computed in pieces)
        # Padding wastes less than an eighth of the rows.
        assert 8 * sum(computed - taken for taken, computed in pieces) < rows
        shapes.update(computed for _, computed in pieces)
    # Exact up to 8 rows, then 8 sizes per power of two up to a piece (the piece itself among
    # them), then whole pieces.
    piece = cpu_linear.ROW_PIECE
    assert set(range(1, 9)) <= shapes
    assert len(shapes) == 8 + 8 * 5 + budget // piece - 1
    assert cpu_linear.row_pieces(0) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 7, 16, 17, 255, 256, 257, 300, 1000])
def test_packed_linear_equals_f_linear(rows: int, dtype: torch.dtype) -> None:
    torch.manual_seed(rows)
    weight, bias = torch.randn(96, 64, dtype=dtype), torch.randn(96, dtype=dtype)
    x = torch.randn(rows, 64, dtype=dtype)
    packed = cpu_linear.pack(weight)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    for b in (bias, None):
        ours = cpu_linear.linear(x, packed, b)
        assert ours.shape == (rows, 96) and ours.dtype == dtype
        torch.testing.assert_close(ours, F.linear(x, weight, b), atol=tolerance, rtol=tolerance)


def test_leading_dimensions_are_kept():
    weight = torch.randn(32, 16)
    x = torch.randn(3, 70, 16)
    out = cpu_linear.linear(x, cpu_linear.pack(weight), None)
    torch.testing.assert_close(out, F.linear(x, weight), atol=1e-4, rtol=1e-4)
