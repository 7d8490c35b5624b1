"""The C++ passes of the layers' elementwise work against their torch contract
(``pagedllm.kernels.layer_ops``), in float32 and bfloat16, on the strided views the model
passes (q and k are column slices of the fused qkv projection)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import OPS, cpu_extension, cpu_ops, kernel_ops, layer_ops, reference

pytestmark = pytest.mark.skipif(not cpu_extension.load(), reason="no C++ compiler")

DTYPES = [torch.float32, torch.bfloat16]
# float32: summation order only; bfloat16: one rounding of the result either way.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1e-2)}


def assert_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    assert ours.dtype == reference.dtype and ours.shape == reference.shape
    torch.testing.assert_close(ours, reference, **TOLERANCE[ours.dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,size", [(1, 576), (33, 576), (5, 100), (4, 7)])
def test_rms_norm(dtype, rows, size):
    x = torch.randn(rows, size).to(dtype) * 3
    weight = torch.rand(size).to(dtype) + 0.5
    assert_close(cpu_ops.rms_norm(x, weight, 1e-5), layer_ops.rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_heads_of_a_strided_view(dtype):
    # Qwen3's q/k norms: each head a row, the heads a slice of the qkv projection.
    qkv = torch.randn(6, 5 * 64).to(dtype)
    q = qkv[:, : 3 * 64].view(6, 3, 64)
    weight = torch.rand(64).to(dtype) + 0.5
    assert_close(cpu_ops.rms_norm(q, weight, 1e-6), layer_ops.rms_norm(q, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 40])
def test_add_rms_norm_writes_the_norm_and_the_sum_in_place(dtype, rows):
    x, residual = torch.randn(rows, 576).to(dtype), torch.randn(rows, 576).to(dtype)
    weight = torch.rand(576).to(dtype) + 0.5
    want_norm, want_sum = layer_ops.add_rms_norm(x, residual, weight, 1e-5)
    x_in, residual_in = x.clone(), residual.clone()
    normed, summed = cpu_ops.add_rms_norm(x_in, residual_in, weight, 1e-5)
    assert normed.data_ptr() == x_in.data_ptr() and summed.data_ptr() == residual_in.data_ptr()
    assert torch.equal(summed, want_sum)  # one rounded add, as torch's
    assert_close(normed, want_norm)


def rotary_inputs(tokens: int, dtype: torch.dtype, head_dim: int = 64):
    qkv = torch.randn(tokens, (9 + 2 * 3) * head_dim).to(dtype)
    q = qkv[:, : 9 * head_dim].view(tokens, 9, head_dim)
    k = qkv[:, 9 * head_dim : 12 * head_dim].view(tokens, 3, head_dim)
    angles = torch.arange(tokens, dtype=torch.float32)[:, None] * torch.rand(head_dim // 2)
    angles = torch.cat((angles, angles), dim=-1)
    return qkv, q, k, angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,head_dim", [(1, 64), (17, 64), (3, 128), (2, 24)])
def test_rotary_embedding_rotates_the_qkv_slices_in_place(dtype, tokens, head_dim):
    qkv, q, k, cos, sin = rotary_inputs(tokens, dtype, head_dim)
    want_q, want_k = layer_ops.rotary_embedding(q, k, cos, sin)
    v_before = qkv[:, 12 * head_dim :].clone()
    got_q, got_k = cpu_ops.rotary_embedding(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    assert_close(got_q, want_q)
    assert_close(got_k, want_k)
    assert torch.equal(qkv[:, 12 * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,size", [(1, 1536), (32, 1536), (3, 21)])
def test_silu_and_mul(dtype, rows, size):
    x = torch.randn(rows, 2 * size).to(dtype) * 4
    assert_close(cpu_ops.silu_and_mul(x), layer_ops.silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_skips_negative_slots_and_reads_strided_rows(dtype):
    qkv = torch.randn(4, 5 * 64).to(dtype)
    key = qkv[:, 64 : 3 * 64].view(4, 2, 64)
    value = qkv[:, 3 * 64 :].view(4, 2, 64)
    slots = torch.tensor([5, -1, 0, 31])
    ours = [torch.zeros(2, 16, 2, 64, dtype=dtype) for _ in range(2)]
    want = [torch.zeros(2, 16, 2, 64, dtype=dtype) for _ in range(2)]
    cpu_ops.write_kv(key, value, *ours, slots)
    reference.write_kv(key, value, *want, slots)
    assert torch.equal(ours[0], want[0]) and torch.equal(ours[1], want[1])
    assert bool(ours[0].any())  # something was written


def test_write_kv_refuses_a_slot_outside_the_cache():
    key = torch.randn(1, 2, 64)
    caches = [torch.zeros(2, 16, 2, 64) for _ in range(2)]
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_ops.write_kv(key, key, *caches, torch.tensor([32]))


@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
def test_every_backend_provides_every_op(backend):
    module = kernel_ops(backend, torch.device("cpu"))
    assert [name for name in OPS if not callable(getattr(module, name, None))] == []


def test_the_ops_named_are_the_contracts():
    from pagedllm.kernels.backend import KernelOps

    assert OPS == tuple(name for name in vars(KernelOps) if not name.startswith("_"))
