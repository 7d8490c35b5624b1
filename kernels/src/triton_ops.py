"""The ``"triton"`` backend: :class:`pagedllm.kernels.backend.KernelOps` with Triton's paged
attention, KV write and block copy. Without a GPU the kernels run on CPU
tensors through Triton's interpreter (see :mod:`pagedllm.kernels.triton_device`).
"""

from __future__ import annotations

import torch

from pagedllm.kernels.cache_ops import copy_blocks as copy_blocks
from pagedllm.kernels.cache_ops import write_kv as write_kv

# Re-exported: this backend's layer ops are the torch ones.
from pagedllm.kernels.layer_ops import add_rms_norm as add_rms_norm
from pagedllm.kernels.layer_ops import rms_norm as rms_norm
from pagedllm.kernels.layer_ops import rotary_embedding as rotary_embedding
from pagedllm.kernels.layer_ops import silu_and_mul as silu_and_mul

# The quantized matmul de-quantizes in torch: GPUs serve quantized models de-quantized at load
# (pagedllm.models.quantized), so this runs only for the interpreter's tests.
from pagedllm.kernels.quant_linear import quant_linear as quant_linear
from pagedllm.kernels.triton_device import multiprocessor_count
from pagedllm.kernels.unified_attention import choose_num_kv_splits, unified_attention


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
    """:func:`pagedllm.kernels.unified_attention.unified_attention`; ``max_seqlen_q`` and
    ``max_seqlen_k`` pick its tile shapes and flash-decoding split."""
    num_seqs = seq_lens_k.shape[0]
    if num_seqs == 0:
        return torch.empty_like(q)
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_seqlen_k is None:
        max_seqlen_k = int(seq_lens_k.max())
    num_kv_splits = choose_num_kv_splits(
        num_seqs, k_cache.shape[2], max_seqlen_q, max_seqlen_k, multiprocessor_count(q.device)
    )
    return unified_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        seq_lens_k,
        scale,
        sliding_window,
        max_seqlen_q,
        num_kv_splits,
    )
