"""Triton kernels that fill and copy KV-cache blocks: the KV write and copy-on-write.

An 8-bit float cache (``float8_e4m3fn``, ``float8_e5m2``) is written as
:func:`pagedllm.kernels.reference.to_cache` defines: saturated at the format's largest finite
value, then rounded to nearest even. The kernel rounds in fp32 arithmetic and encodes the bits
itself, storing bytes, rather than leaving it to Triton's ``.to(tl.float8e4nv)`` /
``.to(tl.float8e5)`` (whose default rounding is "rtne"): Triton has no ``fp8e4nv`` below
sm_89; below sm_89 its ``fp8e5`` conversion rounds half away from zero, from fp32 after
truncating to fp16, and does not saturate (sm_89 and up convert with ``cvt.rn.satfinite``);
and its interpreter rounds ties away from zero, loses carries into the exponent (1.9375 ->
1.0 in e4m3), truncates subnormals, and makes NaN and out-of-range values finite garbage. The
bytes written here are the reference's on every target and in the interpreter.
"""

from __future__ import annotations

import torch

from pagedllm.kernels.triton_device import tl, triton

# Elements one copy program moves; a block of 64 tokens x 8 heads x 128 dims takes 16.
COPY_CHUNK = 4096

# Copy-on-write moves bits, so it copies in unsigned words the size of an element.
_WORD_OF_SIZE = {1: tl.uint8, 2: tl.uint16, 4: tl.uint32, 8: tl.uint64}

# An 8-bit float format: (mantissa bits, smallest normal exponent, largest finite value).
FP8_FORMATS = {
    torch.float8_e4m3fn: (3, -6, 448.0),
    torch.float8_e5m2: (2, -14, 57344.0),
}


@triton.jit
def _fp8_bits(x, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr, MAX: tl.constexpr):
    """The 8-bit float (as uint8) that ``x`` saturates and rounds to nearest even to.

    Rounds in fp32: adding 2^(e - MANTISSA_BITS + 23), e being ``x``'s exponent (at least the
    smallest normal one, which gives subnormals their fixed spacing), leaves fp32 the 8-bit
    format's spacing at ``x``, so fp32's own round-to-nearest-even rounds the sum, and taking
    the addend off again is exact. The rounded value is on the 8-bit grid; its bits are the
    fp32 exponent rebiased over the top mantissa bits, or for subnormals the count of the
    smallest subnormal it holds. NaN stays NaN (0x7f, in both formats).
    """
    x = tl.clamp(x.to(tl.float32), -MAX, MAX, propagate_nan=tl.PropagateNan.ALL)
    bits = x.to(tl.int32, bitcast=True)
    magnitude = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, MIN_EXPONENT)
    addend = ((exponent + (127 + 23 - MANTISSA_BITS)) << 23).to(tl.float32, bitcast=True)
    rounded = (magnitude + addend) - addend
    rounded_bits = rounded.to(tl.int32, bitcast=True)
    # Rebiasing: fp32's exponent bias is 127, the 8-bit format's 1 - MIN_EXPONENT.
    normal = (rounded_bits >> (23 - MANTISSA_BITS)) - ((127 - 1 + MIN_EXPONENT) << MANTISSA_BITS)
    subnormal = (rounded * (2.0 ** (MANTISSA_BITS - MIN_EXPONENT))).to(tl.int32)
    code = tl.where(rounded >= 2.0**MIN_EXPONENT, normal, subnormal)
    code = tl.where(rounded != rounded, 0x7F, code)
    return (((bits >> 24) & 0x80) | code).to(tl.uint8)


@triton.jit
def _to_cache(
    x, FP8_MANTISSA_BITS: tl.constexpr, FP8_MIN_EXPONENT: tl.constexpr, FP8_MAX: tl.constexpr
):
    """``x`` as the cache holds it: an 8-bit float's bits (FP8_MANTISSA_BITS > 0) or ``x``."""
    if FP8_MANTISSA_BITS > 0:
        held = _fp8_bits(x, FP8_MANTISSA_BITS, FP8_MIN_EXPONENT, FP8_MAX)
    else:
        held = x
    return held


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]; uint8 for 8-bit floats
    v_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64
    stride_key_token: tl.int64,
    stride_key_head: tl.int64,
    stride_value_token: tl.int64,
    stride_value_head: tl.int64,
    stride_k_block: tl.int64,
    stride_k_slot: tl.int64,
    stride_k_head: tl.int64,
    stride_v_block: tl.int64,
    stride_v_slot: tl.int64,
    stride_v_head: tl.int64,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PADDED: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8_MANTISSA_BITS: tl.constexpr,  # 0: the cache holds a wider float; else it holds bytes
    FP8_MIN_EXPONENT: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    slot_in_block = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PADDED)[:, None]
    dims = tl.arange(0, HEAD_DIM_PADDED)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)

    key = tl.load(key_ptr + token * stride_key_token + heads * stride_key_head + dims, mask=mask)
    tl.store(
        k_cache_ptr
        + block * stride_k_block
        + slot_in_block * stride_k_slot
        + heads * stride_k_head
        + dims,
        _to_cache(key, FP8_MANTISSA_BITS, FP8_MIN_EXPONENT, FP8_MAX).to(
            k_cache_ptr.dtype.element_ty
        ),
        mask=mask,
    )
    value = tl.load(
        value_ptr + token * stride_value_token + heads * stride_value_head + dims, mask=mask
    )
    tl.store(
        v_cache_ptr
        + block * stride_v_block
        + slot_in_block * stride_v_slot
        + heads * stride_v_head
        + dims,
        _to_cache(value, FP8_MANTISSA_BITS, FP8_MIN_EXPONENT, FP8_MAX).to(
            v_cache_ptr.dtype.element_ty
        ),
        mask=mask,
    )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """:meth:`pagedllm.kernels.backend.KernelOps.write_kv` in one launch, a program per token.

    An 8-bit float cache is written through a byte view of it (see the module's docstring).
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"K and V caches of one dtype, got {k_cache.dtype} and {v_cache.dtype}")
    fp8 = FP8_FORMATS.get(k_cache.dtype, (0, 0, 0.0))
    if fp8[0]:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        FP8_MANTISSA_BITS=fp8[0],
        FP8_MIN_EXPONENT=fp8[1],
        FP8_MAX=fp8[2],
        num_warps=4,
    )


@triton.jit
def _copy_blocks_kernel(
    cache_addresses_ptr,  # [num_caches] int64: every layer's K and V cache
    pairs_ptr,  # [num_pairs, 2] int64: (src, dst)
    block_numel,
    stride_block: tl.int64,
    WORD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pair = tl.program_id(0)
    cache = tl.program_id(1)
    chunk = tl.program_id(2)
    base = tl.load(cache_addresses_ptr + cache).to(tl.pointer_type(WORD))
    src = tl.load(pairs_ptr + 2 * pair)
    dst = tl.load(pairs_ptr + 2 * pair + 1)
    offsets = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offsets < block_numel
    words = tl.load(base + src * stride_block + offsets, mask=mask)
    tl.store(base + dst * stride_block + offsets, words, mask=mask)


def copy_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: torch.Tensor) -> None:
    """:meth:`pagedllm.kernels.backend.KernelOps.copy_blocks` for all layers in one launch.

    The kernel reaches every layer through a table of cache base addresses, so the caches
    must share dtype, shape and strides, each block being one contiguous run of elements.
    Destination blocks must not also be sources (copy-on-write copies into fresh blocks).
    """
    if pairs.numel() == 0 or not kv_caches:
        return
    caches = [cache for layer in kv_caches for cache in layer]
    first = caches[0]
    _, block_size, num_kv_heads, head_dim = first.shape
    block_numel = block_size * num_kv_heads * head_dim
    for cache in caches:
        if (
            cache.dtype != first.dtype
            or cache.shape != first.shape
            or cache.stride() != first.stride()
            or cache.stride()[1:] != (num_kv_heads * head_dim, head_dim, 1)
        ):
            raise ValueError(
                "copy_blocks needs caches of one dtype, shape and strides, each block "
                f"contiguous; got {cache.dtype} {tuple(cache.shape)} strides {cache.stride()} "
                f"beside {first.dtype} {tuple(first.shape)} strides {first.stride()}"
            )
    device = first.device
    addresses = torch.tensor([cache.data_ptr() for cache in caches], dtype=torch.int64)
    chunk = min(COPY_CHUNK, triton.next_power_of_2(block_numel))
    grid = (pairs.shape[0], len(caches), triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](
        addresses.to(device),
        pairs.to(device=device, dtype=torch.int64).contiguous(),
        block_numel,
        first.stride(0),
        WORD=_WORD_OF_SIZE[first.element_size()],
        CHUNK=chunk,
        num_warps=4,
    )
