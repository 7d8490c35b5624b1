"""Quantized weights: every GGUF block format kept quantized repacks to the values of gguf's own
de-quantization, and the layouts' shards, permutations and stacks keep them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from pagedllm.models import ModelLoadError
from pagedllm.models.quantized import (
    KEPT_GGUF_TYPES,
    concat_rows,
    from_gguf_blocks,
    lookup,
    quantize_int8,
)
from pagedllm_testing.gguf_files import random_blocks

ROWS, COLS = 6, 512


def gguf_weight(kind: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random blocks of ``kind`` and gguf's de-quantization of them."""
    data = random_blocks(Q[kind], ROWS, COLS, seed)
    return data, quants.dequantize(data, Q[kind]).reshape(ROWS, COLS)


@pytest.mark.parametrize("kind", KEPT_GGUF_TYPES)
def test_each_block_format_repacks_to_gguf_values(kind):
    data, expected = gguf_weight(kind)
    weight = from_gguf_blocks(kind, data, ROWS, COLS)
    assert weight.shape == (ROWS, COLS)
    values = weight.dequantize(torch.float32).numpy()
    assert np.abs(expected).max() > 0
    if not kind.endswith("_K"):  # the file's own scales, kept as they are
        np.testing.assert_array_equal(values, expected)
        return
    # The K-quants' products of two scales are rounded once to float16: off by less than a
    # thousandth of the largest weight (a hundredth of a quantization step).
    assert np.abs(values - expected).max() <= 1e-3 * np.abs(expected).max()


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_kept_formats_take_the_memory_of_the_file(kind):
    data, _ = gguf_weight(kind)
    weight = from_gguf_blocks(kind, data, ROWS, COLS)
    assert weight.nbytes == data.nbytes


def test_a_tensor_of_the_wrong_size_is_refused():
    data, _ = gguf_weight("Q4_1")
    with pytest.raises(ModelLoadError, match="cannot hold"):
        from_gguf_blocks("Q4_1", data[:, :-20], ROWS, COLS)


def test_rows_columns_and_stacking_keep_the_values():
    a = from_gguf_blocks("Q4_K", gguf_weight("Q4_K", 1)[0], ROWS, COLS)
    b = from_gguf_blocks("Q6_K", gguf_weight("Q6_K", 2)[0], ROWS, COLS)
    dense_a, dense_b = a.dequantize(torch.float32), b.dequantize(torch.float32)
    stacked = concat_rows([a, b])
    assert (stacked.bits, stacked.group_size) == (8, 16)
    assert torch.equal(stacked.dequantize(torch.float32), torch.cat((dense_a, dense_b)))
    order = torch.tensor([3, 0, 5, 1, 2, 4])
    assert torch.equal(a.rows(order).dequantize(torch.float32), dense_a[order])
    assert torch.equal(a.columns(64, 256).dequantize(torch.float32), dense_a[:, 64:256])
    with pytest.raises(ModelLoadError, match="groups of 32"):
        a.columns(16, 256)


def test_int8_quantization_is_within_half_a_step():
    weight = torch.randn(64, 128)
    quantized = quantize_int8(weight)
    error = (quantized.dequantize(torch.float32) - weight).abs()
    step = quantized.scales.float().repeat_interleave(32, dim=1)
    assert (error <= step / 2 + 1e-6).all()
    assert quantized.nbytes == 64 * 128 + 64 * 4 * 2


def test_lookup_dequantizes_the_rows_asked():
    weight = from_gguf_blocks("Q8_0", gguf_weight("Q8_0")[0], ROWS, COLS)
    ids = torch.tensor([[4, 0], [4, 2]])
    rows = lookup(weight, ids, torch.float32)
    assert rows.shape == (2, 2, COLS)
    assert torch.equal(rows[1, 0], weight.dequantize(torch.float32)[4])
