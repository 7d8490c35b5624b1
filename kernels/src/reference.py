"""The ``"torch"`` backend: :class:`pagedllm.kernels.backend.KernelOps` in plain torch, the
reference the other backends are tested against, and how a cache holds its values
(``to_cache``, ``from_cache``)."""

from __future__ import annotations

import torch

# Re-exported: this backend's layer ops are the torch ones.
from pagedllm.kernels.layer_ops import add_rms_norm as add_rms_norm
from pagedllm.kernels.layer_ops import rms_norm as rms_norm
from pagedllm.kernels.layer_ops import rotary_embedding as rotary_embedding
from pagedllm.kernels.layer_ops import silu_and_mul as silu_and_mul
from pagedllm.kernels.quant_linear import quant_linear as quant_linear

# int8_per_token_head: each (token, KV head) row of the cache holds head_dim int8 values and,
# in its last SCALE_BYTES bytes, their float16 scale: x = scale * q, q in [-127, 127].
INT8_ROWS = torch.int8
SCALE_BYTES = 2
# The 8-bit float caches, stored with a scale of 1.
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def cache_row_size(head_dim: int, dtype: torch.dtype) -> int:
    """The last dimension of a cache of ``dtype`` for heads of ``head_dim``."""
    return head_dim + SCALE_BYTES if dtype == INT8_ROWS else head_dim


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (``[..., head_dim]``) as a cache of ``dtype`` holds it.

    - 8-bit floats (``float8_e4m3fn``, ``float8_e5m2``): saturated at the format's largest
      finite value, then rounded to nearest even; the scale is 1, as vLLM's without
      calibrated scales.
    - ``int8`` (``int8_per_token_head``): symmetric per row, the scale the row's largest
      magnitude over 127 rounded to float16, each value divided by that float16 scale in
      float32 and rounded to nearest even; a row of zeros has scale 0 and values 0.
    - anything else: a plain cast.
    """
    if dtype in FLOAT8:
        limit = torch.finfo(dtype).max
        return x.float().clamp(-limit, limit).to(dtype)
    if dtype == INT8_ROWS:
        xf = x.float()
        scale = (xf.abs().amax(-1, keepdim=True) / 127).to(torch.float16)
        divisor = scale.float()
        q = torch.where(divisor > 0, xf / divisor.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
        values = q.round().clamp(-127, 127).to(torch.int8)
        return torch.cat([values, scale.view(torch.int8)], dim=-1)
    return x.to(dtype)


def from_cache(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows (``[..., cache_row_size]``) as values of ``dtype``: what attention reads."""
    if rows.dtype == INT8_ROWS:
        scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float16).float()
        return (rows[..., :-SCALE_BYTES].float() * scale).to(dtype)
    return rows.to(dtype)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """:meth:`KernelOps.write_kv <pagedllm.kernels.backend.KernelOps.write_kv>`."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k[slots] = to_cache(key[keep], k_cache.dtype)
    flat_v[slots] = to_cache(value[keep], v_cache.dtype)


def copy_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: torch.Tensor) -> None:
    """:meth:`KernelOps.copy_blocks <pagedllm.kernels.backend.KernelOps.copy_blocks>`."""
    if pairs.numel() == 0:
        return
    src, dst = pairs[:, 0].long(), pairs[:, 1].long()
    for k_cache, v_cache in kv_caches:
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    k_len: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Masked attention over a padded batch.

    q ``[B, Lq, Hq, D]``, k/v ``[B, Lk, Hkv, D]``, q_positions ``[B, Lq]`` (absolute positions,
    -1 for padding rows), k_len ``[B]``. Returns ``[B, Lq, Hq, D]`` in q's dtype.
    """
    batch, len_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    qf = q.float().view(batch, len_q, num_kv_heads, group, head_dim)
    k, v = from_cache(k, torch.float32), from_cache(v, torch.float32)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qf, k) * scale
    k_pos = torch.arange(k.shape[1], device=q.device)
    allowed = (k_pos[None, None, :] <= q_positions[:, :, None]) & (
        k_pos[None, None, :] < k_len[:, None, None]
    )
    if sliding_window is not None:
        allowed &= k_pos[None, None, :] > q_positions[:, :, None] - sliding_window
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v)
    return out.reshape(batch, len_q, num_heads, head_dim).to(q.dtype)


def _gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``[B, num_blocks * block_size, Hkv, D]`` view of each sequence's first blocks."""
    blocks = cache[block_tables[:, :num_blocks].long()]
    return blocks.reshape(blocks.shape[0], -1, *cache.shape[2:])


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
    """:meth:`KernelOps.paged_attention <pagedllm.kernels.backend.KernelOps.paged_attention>`:
    decode rows as one padded batch, longer chunks one sequence at a time."""
    num_seqs = seq_lens_k.shape[0]
    out = q.new_empty(q.shape)
    if num_seqs == 0:
        return out
    block_size = k_cache.shape[1]
    seq_lens_k = seq_lens_k.long()
    starts = cu_seqlens_q[:-1].long()
    q_lens = cu_seqlens_q[1:].long() - starts
    decode = q_lens == 1
    if bool(decode.any()):
        # Single-query sequences attend as one padded batch.
        idx = decode.nonzero()[:, 0]
        lens = seq_lens_k[idx]
        num_blocks = (int(lens.max()) + block_size - 1) // block_size
        k = _gather_kv(k_cache, block_tables[idx], num_blocks)
        v = _gather_kv(v_cache, block_tables[idx], num_blocks)
        rows = starts[idx]
        out[rows] = _attend(
            q[rows][:, None], k, v, (lens - 1)[:, None], lens, scale, sliding_window
        )[:, 0]
    # Longer chunks (prefill) one sequence at a time: padding them together wastes compute.
    for i in (~decode & (q_lens > 0)).nonzero()[:, 0].tolist():
        start, q_len, k_len = int(starts[i]), int(q_lens[i]), int(seq_lens_k[i])
        num_blocks = (k_len + block_size - 1) // block_size
        k = _gather_kv(k_cache, block_tables[i : i + 1], num_blocks)
        v = _gather_kv(v_cache, block_tables[i : i + 1], num_blocks)
        positions = torch.arange(k_len - q_len, k_len, device=q.device)[None]
        lens = seq_lens_k[i : i + 1]
        out[start : start + q_len] = _attend(
            q[None, start : start + q_len], k, v, positions, lens, scale, sliding_window
        )[0]
    return out
