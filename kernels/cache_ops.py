"""Triton kernels that fill and copy KV-cache blocks: the KV write and copy-on-write."""

from __future__ import annotations

import torch

from pagedllm.kernels.triton_device import tl, triton

# Elements one copy program moves; a block of 64 tokens x 8 heads x 128 dims takes 16.
COPY_CHUNK = 4096

# Copy-on-write moves bits, so it copies in unsigned words the size of an element.
_WORD_OF_SIZE = {1: tl.uint8, 2: tl.uint16, 4: tl.uint32, 8: tl.uint64}


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
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
        key.to(k_cache_ptr.dtype.element_ty),
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
        value.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """:func:`pagedllm.kernels.reference.write_kv` in one launch, a program per token."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
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
    """:func:`pagedllm.kernels.reference.copy_blocks` for all layers in one launch.

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
