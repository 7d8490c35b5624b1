"""The ``"cpu"`` backend: :class:`pagedllm.kernels.backend.KernelOps` for CPU tensors.

Decode rows (one new token) go through the
C++ kernel of :mod:`pagedllm.kernels.cpu_extension`, which reads K/V in place through the
block table; where it cannot be built they gather their blocks and use torch's
``scaled_dot_product_attention``. Short multi-token steps (speculative decoding's verification
of a few drafts) go through the same kernel, one row per query whose keys end at its own
position. Longer prefill chunks gather their sequence's blocks and use
``scaled_dot_product_attention`` with the causal mask of their positions.

The layers' elementwise work (RMSNorm with and without the residual add, the rotary embedding,
SiLU·mul), the quantized matmul and the KV write run as single C++ passes where the kernels
are built; without them, the torch code of :mod:`pagedllm.kernels.layer_ops`,
:mod:`pagedllm.kernels.quant_linear` and :mod:`pagedllm.kernels.reference`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu_extension, layer_ops
from pagedllm.kernels import quant_linear as quant_reference
from pagedllm.kernels.reference import FLOAT8, INT8_ROWS, from_cache, to_cache
from pagedllm.kernels.reference import copy_blocks as copy_blocks

# The 8-bit caches besides the activations' dtype (8-bit floats, int8 rows with their scales):
# read in place by the C++ decode kernel, widened per chunk for torch's prefill attention.
EIGHT_BIT = (*FLOAT8, INT8_ROWS)

# Steps of at most this many tokens of a sequence run as decode rows: a row per query reads
# the sequence's keys in place, which for a few queries beats gathering a copy per sequence
# and layer (one kernel call for the whole batch instead of a Python loop over sequences).
MAX_ROWS_AS_DECODE = 16


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    same = key.dtype == k_cache.dtype and value.dtype == v_cache.dtype
    if (
        cpu_extension.load()
        and (same or k_cache.dtype in EIGHT_BIT)
        and slot_mapping.dtype == torch.long
    ):
        torch.ops.pagedllm_cpu.write_kv(key, value, k_cache, v_cache, slot_mapping)
        return
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        key, value, slots = key[keep], value[keep], slots[keep]
    for x, cache in ((key, k_cache), (value, v_cache)):
        rows = to_cache(x, cache.dtype)
        if cache.dtype in FLOAT8:  # index_copy_ has no 8-bit float kernel: copy the bytes
            rows, cache = rows.view(torch.uint8), cache.view(torch.uint8)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows)


def _fused(x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    """Whether the C++ pass takes ``x`` (and ``weight``): built, and one dtype."""
    return cpu_extension.load() and (weight is None or weight.dtype == x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _fused(x, weight):
        return layer_ops.rms_norm(x, weight, eps)
    rows = x.reshape(-1, x.shape[-1])  # q/k norms: heads as rows (a copy of a strided view)
    return torch.ops.pagedllm_cpu.rms_norm(rows, weight, eps).view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``x`` becomes the norm and ``residual`` the sum."""
    if not (_fused(x, weight) and x.dim() == 2 and x.stride(-1) == 1 and residual.is_contiguous()):
        return layer_ops.add_rms_norm(x, residual, weight, eps)
    torch.ops.pagedllm_cpu.add_rms_norm(x, residual, weight, eps)
    return x, residual


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place."""
    if not (_fused(q, cos) and q.stride(-1) == 1 and k.stride(-1) == 1):
        return layer_ops.rotary_embedding(q, k, cos, sin)
    torch.ops.pagedllm_cpu.rotary_embedding(q, k, cos, sin)
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if not (_fused(x) and x.dim() == 2 and x.stride(-1) == 1):
        return layer_ops.silu_and_mul(x)
    return torch.ops.pagedllm_cpu.silu_and_mul(x)


def quant_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    if not cpu_extension.load():
        return quant_reference.quant_linear(x, qweight, scales, mins, bits, group_size)
    if x.dim() == 2:  # the engine's tokens; a decode step makes 4 calls a layer
        return torch.ops.pagedllm_cpu.quant_linear(x, qweight, scales, mins, bits, group_size)
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.pagedllm_cpu.quant_linear(rows, qweight, scales, mins, bits, group_size)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _gather(
    cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int, dtype: torch.dtype
) -> torch.Tensor:
    """``[B, Hkv, num_tokens, D]`` (a strided view of a copy, in ``dtype``) of each sequence's
    first tokens."""
    num_blocks = (num_tokens + cache.shape[1] - 1) // cache.shape[1]
    blocks = from_cache(cache[block_tables[:, :num_blocks].long()], dtype)
    flat = blocks.reshape(blocks.shape[0], -1, *blocks.shape[3:])
    return flat[:, :num_tokens].transpose(1, 2)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """q ``[B, Hq, Lq, D]``, k/v ``[B, Hkv, Lk, D]``, allowed ``[B, Lq, Lk]`` -> ``[B, Lq, Hq, D]``.

    Rows with no allowed key (a window past every key cannot happen, but padding can) give 0.
    """
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed[:, None], scale=scale, enable_gqa=True
    )
    return out.nan_to_num(0.0).transpose(1, 2)


def _allowed(
    q_positions: torch.Tensor, k_len: torch.Tensor, num_keys: int, sliding_window: int | None
) -> torch.Tensor:
    """``[B, Lq, Lk]``: which keys each query may see (causal, within the sequence and window)."""
    k_pos = torch.arange(num_keys, device=q_positions.device)[None, None, :]
    allowed = (k_pos <= q_positions[:, :, None]) & (k_pos < k_len[:, None, None])
    if sliding_window is not None:
        allowed &= k_pos > q_positions[:, :, None] - sliding_window
    return allowed


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens_k: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One query per sequence (``q`` is ``[num_seqs, Hq, D]``) over its ``seq_lens_k`` keys."""
    if cpu_extension.load():
        if seq_lens_k.dtype not in (torch.int32, torch.long):
            seq_lens_k = seq_lens_k.long()
        return torch.ops.pagedllm_cpu.paged_decode_attention(
            q,
            k_cache,
            v_cache,
            block_tables.to(torch.int32).contiguous(),
            seq_lens_k.contiguous(),
            scale,
            sliding_window or 0,
        )
    seq_lens_k = seq_lens_k.long()
    num_keys = int(seq_lens_k.max())
    k = _gather(k_cache, block_tables, num_keys, q.dtype)
    v = _gather(v_cache, block_tables, num_keys, q.dtype)
    allowed = _allowed((seq_lens_k - 1)[:, None], seq_lens_k, num_keys, sliding_window)
    return _sdpa(q[:, :, None], k, v, allowed, scale)[:, 0]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
) -> torch.Tensor:
    """Pure decode steps as one call of the decode kernel; short steps (a few drafts) as a
    decode row per query; longer chunks one sequence at a time."""
    num_seqs = seq_lens_k.shape[0]
    if num_seqs == 0:
        return torch.empty_like(q)
    if q.dtype != k_cache.dtype and k_cache.dtype not in EIGHT_BIT:
        # a cache kept in another float dtype than the activations
        return paged_attention(
            q.to(k_cache.dtype),
            k_cache,
            v_cache,
            block_tables,
            cu_seqlens_q,
            seq_lens_k,
            scale,
            sliding_window,
            max_seqlen_q,
            max_seqlen_k,
        ).to(q.dtype)
    if max_seqlen_q == 1 and q.shape[0] == num_seqs:  # a pure decode step
        return decode_attention(
            q, k_cache, v_cache, block_tables, seq_lens_k, scale, sliding_window
        )
    out = q.new_zeros(q.shape)
    seq_lens_k = seq_lens_k.long()
    starts = cu_seqlens_q[:-1].long()
    q_lens = cu_seqlens_q[1:].long() - starts
    short = (q_lens <= MAX_ROWS_AS_DECODE).nonzero()[:, 0]
    if short.numel():
        # Query j of a sequence with q_len queries and k_len keys is causal attention over
        # its first k_len - q_len + j + 1 keys: exactly a decode row of that length.
        counts = q_lens[short]
        seq_of_row = torch.repeat_interleave(short, counts)
        first_row = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        offset = torch.arange(seq_of_row.numel(), device=q.device) - first_row
        rows = starts[seq_of_row] + offset
        out[rows] = decode_attention(
            q[rows],
            k_cache,
            v_cache,
            block_tables[seq_of_row],
            seq_lens_k[seq_of_row] - q_lens[seq_of_row] + offset + 1,
            scale,
            sliding_window,
        )
    for i in (q_lens > MAX_ROWS_AS_DECODE).nonzero()[:, 0].tolist():
        start, q_len, k_len = int(starts[i]), int(q_lens[i]), int(seq_lens_k[i])
        k = _gather(k_cache, block_tables[i : i + 1], k_len, q.dtype)
        v = _gather(v_cache, block_tables[i : i + 1], k_len, q.dtype)
        chunk = q[None, start : start + q_len].transpose(1, 2)
        if sliding_window is None and hasattr(torch.ops.aten, FLASH):
            out[start : start + q_len] = _causal_chunk(chunk, k, v, scale)[0]
            continue
        positions = torch.arange(k_len - q_len, k_len, device=q.device)[None]
        allowed = _allowed(positions, seq_lens_k[i : i + 1], k_len, sliding_window)
        out[start : start + q_len] = _sdpa(chunk, k, v, allowed, scale)[0]
    return out


# torch's flash attention for the CPU, which returns each row's log-sum-exp beside its output.
FLASH = "_scaled_dot_product_flash_attention_for_cpu"


def _causal_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A prompt chunk's causal attention (no window): q ``[1, Hq, Lq, D]`` the chunk's queries,
    k/v ``[1, Hkv, Lk, D]`` with the chunk's own keys last -> ``[1, Lq, Hq, D]``.

    Through torch's flash kernel, twice when the chunk follows a prefix: the prefix without a
    mask, the chunk's own keys causally (the kernel aligns its causal mask to the first key),
    the two merged by their log-sum-exps, rather than a masked kernel that materializes every
    score beside a boolean mask (twice as slow on long chunks: ``docs/design/kernels.md``)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:  # the flash kernel takes as many K/V heads as query heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    flash = getattr(torch.ops.aten, FLASH)
    prefix = k.shape[2] - q.shape[2]
    out, lse = flash(q, k[:, :, prefix:], v[:, :, prefix:], 0.0, True, scale=scale)
    if prefix > 0:
        old, old_lse = flash(q, k[:, :, :prefix], v[:, :, :prefix], 0.0, False, scale=scale)
        top = torch.maximum(lse, old_lse)
        w_new, w_old = (lse - top).exp()[..., None], (old_lse - top).exp()[..., None]
        out = (out.float() * w_new + old.float() * w_old) / (w_new + w_old)
    return out.to(q.dtype).transpose(1, 2)
