"""The quantized matmul: the C++ kernel against its torch contract
(``pagedllm.kernels.quant_linear``) for every layout it takes, at decode row counts (the weight
de-quantized in registers, or with VNNI the rows quantized to int8 groups) and at prefill row
counts (a float GEMM over the de-quantized weight), and the contract itself against a dense
matmul."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import OPS, cpu_extension, cpu_ops, kernel_ops, quant_linear

pytestmark = pytest.mark.skipif(not cpu_extension.load(), reason="no C++ compiler")

# (bits, group size, with minimums): GGUF's Q4_0/Q4_1/Q4_K, Q8_0/Q5_0, Q5_1/Q5_K, Q6_K.
LAYOUTS = [(4, 32, True), (4, 32, False), (8, 32, False), (8, 32, True), (8, 16, False)]


def random_weight(out_features: int, in_features: int, bits: int, group: int, with_mins: bool):
    groups = in_features // group
    if bits == 4:
        qweight = torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8)
    else:
        qweight = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8)
    scales = (torch.rand(out_features, groups) * 0.02 + 0.001).half()
    mins = (torch.randn(out_features, groups) * 0.05).half() if with_mins else None
    return qweight, scales, mins


def test_the_contract_is_a_matmul_by_the_dequantized_weight():
    qweight, scales, mins = random_weight(8, 64, 4, 32, True)
    weight = quant_linear.dequantize(qweight, scales, mins, 4, 32)
    # Byte i of a group holds value i (low nibble) and value i + 16 (high nibble).
    low, high = int(qweight[0, 0]) & 15, int(qweight[0, 0]) >> 4
    assert weight[0, 0] == low * scales[0, 0].float() + mins[0, 0].float()
    assert weight[0, 16] == high * scales[0, 0].float() + mins[0, 0].float()
    x = torch.randn(3, 64)
    torch.testing.assert_close(
        quant_linear.quant_linear(x, qweight, scales, mins, 4, 32), F.linear(x, weight)
    )


def test_every_backend_has_the_op():
    assert "quant_linear" in OPS
    for backend in ("cpu", "torch", "triton"):
        assert callable(kernel_ops(backend, torch.device("cpu")).quant_linear)


@pytest.mark.parametrize("bits,group,with_mins", LAYOUTS)
@pytest.mark.parametrize("rows", [1, 3, 16, 200])
# 576 features: two groups of 32 a step (512-bit registers with VNNI); 608: one a step.
@pytest.mark.parametrize("in_features", [576, 608])
def test_the_kernel_matches_the_contract(bits, group, with_mins, rows, in_features):
    torch.manual_seed(rows)
    qweight, scales, mins = random_weight(70, in_features, bits, group, with_mins)
    x = torch.randn(rows, in_features)
    ours = cpu_ops.quant_linear(x, qweight, scales, mins, bits, group)
    expected = quant_linear.quant_linear(x, qweight, scales, mins, bits, group)
    assert ours.shape == expected.shape == (rows, 70)
    # int8 rows (VNNI) leave each product within half a step of 1/127 of its group's largest
    # value: well under a percent of the outputs' range; the float paths round only.
    error = (ours - expected).abs().max() / expected.abs().max()
    assert error < 1e-2, error


def test_bfloat16_rows_and_leading_dimensions():
    qweight, scales, mins = random_weight(40, 64, 4, 32, True)
    x = torch.randn(2, 3, 64)
    ours = cpu_ops.quant_linear(x.bfloat16(), qweight, scales, mins, 4, 32)
    assert ours.dtype == torch.bfloat16 and ours.shape == (2, 3, 40)
    expected = quant_linear.quant_linear(x, qweight, scales, mins, 4, 32)
    assert ((ours.float() - expected).abs().max() / expected.abs().max()) < 2e-2


@pytest.mark.parametrize("bits,group,with_mins", LAYOUTS)
@pytest.mark.parametrize("rows", [1, 5, 16, 200])
def test_bfloat16_rows_give_the_float32_rows_products_rounded(bits, group, with_mins, rows):
    """bfloat16 rows are read as they are (widening is exact) and the output rounded once:
    the same numbers as the float32 call on the same values, rounded to bfloat16."""
    torch.manual_seed(rows)
    qweight, scales, mins = random_weight(70, 576, bits, group, with_mins)
    x = torch.randn(rows, 576).bfloat16()
    ours = cpu_ops.quant_linear(x, qweight, scales, mins, bits, group)
    assert ours.dtype == torch.bfloat16
    expected = cpu_ops.quant_linear(x.float(), qweight, scales, mins, bits, group).bfloat16()
    assert torch.equal(ours, expected)


def test_no_rows_give_no_rows():
    qweight, scales, mins = random_weight(8, 64, 8, 32, False)
    assert cpu_ops.quant_linear(torch.empty(0, 64), qweight, scales, mins, 8, 32).shape == (0, 8)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda q, s, m: (q[:, :-1].contiguous(), s, m), "qweight must be"),
        (lambda q, s, m: (q, s.float(), m), "scales must be"),
        (lambda q, s, m: (q, s, m[:-1]), "mins must be"),
    ],
)
def test_bad_layouts_are_refused(change, message):
    qweight, scales, mins = change(*random_weight(8, 64, 4, 32, True))
    with pytest.raises(RuntimeError, match=message):
        torch.ops.pagedllm_cpu.quant_linear(torch.randn(1, 64), qweight, scales, mins, 4, 32)
