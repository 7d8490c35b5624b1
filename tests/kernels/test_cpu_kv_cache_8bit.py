"""The CPU backend over 8-bit KV caches (``--kv-cache-dtype fp8|fp8_e4m3|fp8_e5m2`` and
``int8_per_token_head``): the write rounds (and saturates, or scales) as
:func:`pagedllm.kernels.reference.to_cache`, byte for byte; the C++ decode kernel reads the
bytes in place and attends as the reference does over the same values; prompt chunks widen
their sequence's blocks for torch's attention."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import cpu_extension, cpu_ops, reference

pytestmark = pytest.mark.skipif(not cpu_extension.load(), reason="the C++ CPU kernels")

EIGHT_BIT = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]
NUM_BLOCKS, BLOCK, KV_HEADS = 24, 16, 2


def caches(dtype: torch.dtype, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (NUM_BLOCKS, BLOCK, KV_HEADS, reference.cache_row_size(head_dim, dtype))
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize("cache_dtype", EIGHT_BIT)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_write_rounds_and_saturates_like_the_reference(dtype, cache_dtype):
    torch.manual_seed(0)
    tokens = 100
    key = (torch.randn(tokens, KV_HEADS, 64) * 4).to(dtype)
    value = torch.randn(tokens, KV_HEADS, 64).to(dtype)
    # Beyond both formats' range, either sign; subnormals of both; exact zeros.
    key[0, 0, :6] = torch.tensor([6e4, -6e4, 1e-3, -2e-5, 0.0, 500.0]).to(dtype)
    key[1] = 0.0
    slots = torch.randperm(NUM_BLOCKS * BLOCK)[:tokens]
    slots[3] = -1  # not written
    ours, theirs = caches(cache_dtype, 64), caches(cache_dtype, 64)
    cpu_ops.write_kv(key, value, *ours, slots)
    reference.write_kv(key, value, *theirs, slots)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    rows = ours[0].view(-1, KV_HEADS, ours[0].shape[-1])
    read = reference.from_cache(rows[slots[0], 0], torch.float32)
    if cache_dtype == torch.int8:
        # A scale per row: the largest magnitude is kept to its float16 scale's precision.
        largest = key[0, 0, 0].float().item()
        assert abs(read[0].item() - largest) < largest * 2**-10
        assert read[1].item() == -read[0].item()
        assert torch.equal(rows[slots[1], 0], torch.zeros_like(rows[0, 0]))  # zeros: scale 0
        kept = slots >= 0
        values = ours[1].view(-1, KV_HEADS, ours[1].shape[-1])[slots[kept]]
        want = value[kept].float()
        error = (reference.from_cache(values, torch.float32) - want).abs().amax(-1)
        # Half a step of the row's scale (its largest magnitude over 127), within float16's.
        assert bool((error <= 1.01 * want.abs().amax(-1) / 254).all())
    else:
        limit = torch.finfo(cache_dtype).max
        assert read[:2].tolist() == [limit, -limit]  # saturated, never inf or NaN
        assert bool(torch.isfinite(ours[0].float()).all())


def attention_case(dtype, cache_dtype, head_dim, lens):
    generator = torch.Generator().manual_seed(head_dim + len(lens))
    shape = (NUM_BLOCKS, BLOCK, KV_HEADS, head_dim)
    k_cache = reference.to_cache(torch.randn(shape, generator=generator) * 2, cache_dtype)
    v_cache = reference.to_cache(torch.randn(shape, generator=generator), cache_dtype)
    width = max(-(-n // BLOCK) for n in lens)
    order = torch.randperm(NUM_BLOCKS, generator=generator)
    tables = torch.stack([order[i : i + width] for i in range(len(lens))]).int()
    return k_cache, v_cache, tables, torch.tensor(lens)


@pytest.mark.parametrize("cache_dtype", EIGHT_BIT)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 40])  # the vector paths and the plain loops
@pytest.mark.parametrize("window", [None, 7])
def test_decode_reads_the_8bit_cache_in_place_like_the_reference(
    dtype, cache_dtype, head_dim, window
):
    lens = [150, 1, 77, 16]
    k_cache, v_cache, tables, seq_lens = attention_case(dtype, cache_dtype, head_dim, lens)
    q = torch.randn(len(lens), 3 * KV_HEADS, head_dim).to(dtype)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32)
    args = (q, k_cache, v_cache, tables, cu, seq_lens, head_dim**-0.5, window)
    ours = cpu_ops.paged_attention(*args, max_seqlen_q=1)
    theirs = reference.paged_attention(*args, max_seqlen_q=1)
    assert ours.dtype == dtype
    tolerance = 2e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(ours.float(), theirs.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("cache_dtype", [None, *EIGHT_BIT])  # None: the activations' dtype
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 20])
def test_prompt_chunks_and_short_rows_attend_like_the_reference(dtype, cache_dtype, window):
    """A chunk after a prefix and a whole prompt (torch's flash kernel, the chunk after a
    prefix merged by log-sum-exp; with a window, the masked kernel), and short rows (the
    decode kernel)."""
    lens = [150, 60, 9, 30]
    q_lens = [40, 5, 9, 30]
    k_cache, v_cache, tables, seq_lens = attention_case(dtype, cache_dtype or dtype, 64, lens)
    q = torch.randn(sum(q_lens), 3 * KV_HEADS, 64).to(dtype)
    cu = torch.tensor([0, 40, 45, 54, 84], dtype=torch.int32)
    args = (q, k_cache, v_cache, tables, cu, seq_lens, 0.125, window)
    ours = cpu_ops.paged_attention(*args, max_seqlen_q=40)
    theirs = reference.paged_attention(*args, max_seqlen_q=40)
    tolerance = 1e-5 if dtype == torch.float32 else 2**-6
    torch.testing.assert_close(ours.float(), theirs.float(), atol=tolerance, rtol=tolerance)


def test_the_kernel_refuses_caches_it_cannot_read():
    k_cache, v_cache, tables, seq_lens = attention_case(
        torch.float32, torch.float8_e4m3fn, 64, [20]
    )
    q = torch.randn(1, 4, 64)
    attention = torch.ops.pagedllm_cpu.paged_decode_attention
    with pytest.raises(RuntimeError, match="the caches must share a dtype"):
        attention(q, k_cache, v_cache.to(torch.float8_e5m2), tables, seq_lens, 0.125, 0)
    with pytest.raises(RuntimeError, match="the caches must share a dtype"):
        attention(q, k_cache.to(torch.int16), v_cache.to(torch.int16), tables, seq_lens, 0.1, 0)
    with pytest.raises(RuntimeError, match="int8 rows: head_dim \\+ 2 scale bytes"):
        # int8 rows without room for their scales
        attention(q, k_cache.view(torch.int8), v_cache.view(torch.int8), tables, seq_lens, 0.1, 0)
    key = torch.randn(1, KV_HEADS, 64)
    with pytest.raises(RuntimeError, match="caches' dtype, or the caches 8-bit"):
        torch.ops.pagedllm_cpu.write_kv(key, key.bfloat16(), k_cache, v_cache, torch.tensor([0]))
