"""Packed matmuls (the C++ panels for float32 and bfloat16 on AVX-512 CPUs, else MKL for
float32 and oneDNN):
the same numbers as ``F.linear``; oneDNN's on a bounded set of row counts (it keeps a
primitive per input shape it sees, so unbounded shapes grow the worker)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu_extension
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_leading_dimensions_and_strided_inputs_are_kept(dtype: torch.dtype) -> None:
    weight = torch.randn(32, 16, dtype=dtype)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    packed = cpu_linear.pack(weight)
    x = torch.randn(3, 70, 16, dtype=dtype)
    out = cpu_linear.linear(x, packed, None)
    torch.testing.assert_close(out, F.linear(x, weight), atol=tolerance, rtol=tolerance)
    strided = torch.randn(40, 48, dtype=dtype)[:, 8:24]  # q, k or v of a fused projection
    out = cpu_linear.linear(strided, packed, None)
    torch.testing.assert_close(out, F.linear(strided, weight), atol=tolerance, rtol=tolerance)


PANELS = cpu_extension.has_avx512() and cpu_extension.load()


def float32_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """``F.linear`` in float32 over the same values, rounded to ``x``'s dtype once at the end:
    what the panels compute (float32 products and sums)."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), b).to(x.dtype)


@pytest.mark.skipif(not PANELS, reason="the panel matmul needs AVX-512 and the C++ kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features", [1, 16, 40, 64, 97])
def test_weights_in_panels_equal_f_linear_at_every_row_count(out_features, dtype) -> None:
    torch.manual_seed(out_features)
    weight = torch.randn(out_features, 72, dtype=dtype)
    bias = torch.randn(out_features, dtype=dtype)
    packed = cpu_linear.pack(weight)
    assert packed.panels and packed.stand_in is None and packed.data.dtype == dtype
    # Pairs of 16-feature panels, the padding zero: the weight's bytes and less than a pair.
    size = weight.element_size()
    assert weight.numel() * size <= packed.nbytes < (out_features + 32) * 72 * size
    for rows in [*range(0, 27), 47, 300]:  # every tile of up to 12 rows, and their sums
        x = torch.randn(rows, 72, dtype=dtype)
        for b in (bias, None):
            ours = cpu_linear.linear(x, packed, b)
            assert ours.shape == (rows, out_features) and ours.dtype == dtype
            if dtype == torch.float32:
                torch.testing.assert_close(ours, F.linear(x, weight, b), atol=1e-4, rtol=1e-4)
            else:  # the float32 result rounded once: equal but for a last bit of rounding
                want = float32_product(x, weight, b)
                torch.testing.assert_close(ours, want, atol=0, rtol=2**-7)


@pytest.mark.skipif(not PANELS, reason="the panel matmul needs AVX-512 and the C++ kernels")
def test_a_bfloat16_weight_of_odd_width_stays_with_onednn() -> None:
    weight = torch.randn(40, 23, dtype=torch.bfloat16)
    packed = cpu_linear.pack(weight)
    assert not packed.panels and packed.data.is_mkldnn
    x = torch.randn(3, 23, dtype=torch.bfloat16)
    torch.testing.assert_close(
        cpu_linear.linear(x, packed, None), F.linear(x, weight), atol=5e-2, rtol=5e-2
    )


@pytest.mark.skipif(not PANELS, reason="the panel matmul needs AVX-512 and the C++ kernels")
def test_the_panel_matmul_refuses_what_does_not_fit_its_weight() -> None:
    packed = cpu_linear.pack(torch.randn(40, 24))
    panel_linear = torch.ops.pagedllm_cpu.panel_linear
    with pytest.raises(RuntimeError, match="input of 23 features for a weight of 24"):
        panel_linear(torch.randn(2, 23), packed.data, 40, None)
    with pytest.raises(RuntimeError, match="out_features does not fit"):
        panel_linear(torch.randn(2, 24), packed.data, 80, None)
    with pytest.raises(RuntimeError, match="bias of out_features values"):
        panel_linear(torch.randn(2, 24), packed.data, 40, torch.randn(39))
    with pytest.raises(RuntimeError, match="bias of out_features values in the weight's dtype"):
        panel_linear(torch.randn(2, 24), packed.data, 40, torch.randn(40).bfloat16())
    with pytest.raises(RuntimeError, match="float32 input and weight, or bfloat16"):
        panel_linear(torch.randn(2, 24, dtype=torch.bfloat16), packed.data, 40, None)
    with pytest.raises(RuntimeError, match="bfloat16 weight of an even in_features"):
        torch.ops.pagedllm_cpu.pack_linear_weight(torch.randn(4, 5, dtype=torch.bfloat16))


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch built without MKL")
def test_float32_weights_are_packed_for_mkl_once_for_every_row_count(monkeypatch):
    monkeypatch.setattr(cpu_linear, "_panels_available", lambda weight: False)
    weight = torch.randn(200, 72)
    packed = cpu_linear.pack(weight)
    # MKL's layout, with a stand-in of the weight's shape that holds one element, not a copy.
    assert packed.stand_in is not None and packed.stand_in.shape == (200, 72)
    assert packed.stand_in.untyped_storage().nbytes() == 4
    assert packed.nbytes == weight.numel() * 4
    assert cpu_linear.pack(weight.bfloat16()).stand_in is None  # bfloat16: oneDNN
    for rows in (1, 2, 31, 32, 64, 65, 513):  # one packed copy for every row count
        x = torch.randn(rows, 72)
        torch.testing.assert_close(
            cpu_linear.linear(x, packed, None), F.linear(x, weight), atol=1e-4, rtol=1e-4
        )


def test_a_shape_whose_mkl_products_disagree_keeps_onednn(monkeypatch):
    monkeypatch.setattr(cpu_linear, "_panels_available", lambda weight: False)
    monkeypatch.setattr(cpu_linear, "_mkl_checked", {})
    monkeypatch.setattr(cpu_linear, "_mkl_agrees", lambda weight, packed: False)
    weight = torch.randn(24, 40)
    packed = cpu_linear.pack(weight)
    assert packed.stand_in is None and packed.data.is_mkldnn
    x = torch.randn(5, 40)
    torch.testing.assert_close(
        cpu_linear.linear(x, packed, None), F.linear(x, weight), atol=1e-4, rtol=1e-4
    )


# Run in a fresh interpreter: both caches read their capacity when the process builds its
# first primitive. Prints the bytes malloc hands out (glibc's mallinfo2) after filling the
# caches with one primitive per row count, and after as many new row counts again, twice over.
CACHE_GROWTH_SCRIPT = """
import ctypes, sys, torch
from pagedllm.models import cpu_linear

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
mallinfo2.restype = MallInfo2

def in_use():
    info = mallinfo2()
    return info.uordblks + info.hblkhd

cpu_linear.bound_caches()
torch.set_num_threads(1)
packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(1536, 256), 64)
x = torch.randn(4 * cpu_linear.CACHED_PRIMITIVES, 256)

def run(first, last):
    for rows in range(first, last):
        torch.ops.mkldnn._linear_pointwise(x[:rows], packed, None, "none", [], "")

with torch.inference_mode():
    run(1, 2)
    start = in_use()
    size = cpu_linear.CACHED_PRIMITIVES
    run(2, 2 + size)
    filled = in_use()
    run(2 + size, 2 + 3 * size)
    print(filled - start, in_use() - filled)
"""


def test_primitive_caches_hold_a_bounded_number_of_row_counts():
    env = {k: v for k, v in os.environ.items() if k not in cpu_linear.CACHE_CAPACITY_ENVS}
    out = subprocess.run(
        [sys.executable, "-c", CACHE_GROWTH_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    filling, beyond = (int(n) for n in out.split())
    # Each primitive held costs memory (about 0.5 MB for this shape on an AVX-512 machine) ...
    assert filling > cpu_linear.CACHED_PRIMITIVES * 50_000
    # ... but twice as many new row counts once the caches are full take their places: with
    # the default capacities (1,024) they would add twice as much again.
    assert beyond < filling / 4


@pytest.mark.skipif(
    not PANELS or "-mavx512bf16" not in cpu_extension.compiler_flags(),
    reason="the kernels are not built for AVX512-BF16 (the CPU lacks it, or the level chosen "
    "does): its vdpbf16ps products are compiled (tests/kernels/test_cpu_extension.py) but run "
    "only where the CPU has them",
)
def test_bfloat16_panels_take_vdpbf16ps_products_where_the_cpu_has_them() -> None:
    torch.manual_seed(0)
    weight = torch.randn(200, 576, dtype=torch.bfloat16)
    packed = cpu_linear.pack(weight)
    for rows in (1, 12, 13, 64):
        x = torch.randn(rows, 576, dtype=torch.bfloat16)
        want = float32_product(x, weight, None)
        torch.testing.assert_close(cpu_linear.linear(x, packed, None), want, atol=0, rtol=2**-7)


@pytest.mark.skipif(
    not PANELS or "-mamx-bf16" not in cpu_extension.compiler_flags(),
    reason="the kernels are not built for AMX-BF16 (the CPU lacks it, or the level chosen "
    "does): its tile path is compiled (tests/kernels/test_cpu_extension.py) but run only "
    "where the CPU has it",
)
@pytest.mark.parametrize("out_features", [40, 97, 576])
def test_bfloat16_panels_take_amx_tiles_at_prompt_row_counts(out_features: int) -> None:
    torch.manual_seed(out_features)
    weight = torch.randn(out_features, 576, dtype=torch.bfloat16)
    bias = torch.randn(out_features, dtype=torch.bfloat16)
    packed = cpu_linear.pack(weight)
    # From the smallest row count the tiles take, whole and partial blocks of 16 rows.
    for rows in (32, 33, 47, 64, 300):
        x = torch.randn(rows, 576, dtype=torch.bfloat16)
        for b in (bias, None):
            want = float32_product(x, weight, b)
            ours = cpu_linear.linear(x, packed, b)
            # The tiles sum in their own order: sums that cancel to near zero (values here
            # are about 24 in size) may differ by more than their own last bit.
            torch.testing.assert_close(ours, want, atol=2**-5, rtol=2**-7)
