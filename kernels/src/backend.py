"""The contract every kernel backend meets: what ``kernel_ops(backend)`` gives the model.

A backend is a module (``cpu_ops``, ``reference``, ``triton_ops``) whose functions are those of
:class:`KernelOps`; mypy checks each against it (``kernels/src/__init__.py``). The prose of the
contract lives here once; the backends say only how they meet it.

Layout shared by the attention functions:

- a layer's cache is a pair ``(k_cache, v_cache)``, each ``[num_blocks, block_size,
  num_kv_heads, head_dim]``; a token's slot is ``block_id * block_size + offset``;
- queries of a mixed batch are laid out varlen: sequence ``i`` owns rows
  ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]`` of ``q`` (``[num_tokens, num_heads, head_dim]``);
- a cache holds the activations' dtype, 8-bit floats, or int8 rows with a float16 scale each
  (:func:`pagedllm.kernels.reference.to_cache`; ``from_cache`` is what attention reads);
- ``seq_lens_k[i]`` counts all of sequence ``i``'s tokens whose KV is in the cache, the new
  ones included, so its queries sit at positions ``seq_lens_k[i] - q_len .. seq_lens_k[i] - 1``.

The layers' elementwise work follows Hugging Face's Llama family: RMSNorm in float32, the
weight multiplied after rounding to the activations' dtype; the rotary embedding in the
activations' dtype, GPT-NeoX layout (the two halves of a head rotate together). A backend may
compute those in place, so a caller uses what they return and not their inputs afterwards.
The quantized weights' layout is :mod:`pagedllm.kernels.quant_linear`'s.
"""

from __future__ import annotations

from typing import Protocol

import torch


class KernelOps(Protocol):
    def paged_attention(
        self,
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
        """Causal attention of each sequence's new queries over all of its cached KV, each
        query seeing at most the ``sliding_window`` last keys up to its own position.

        ``block_tables`` is ``[num_seqs, max_blocks]`` (int32, unused entries arbitrary).
        ``max_seqlen_q`` and ``max_seqlen_k``, when given, are the largest query and key
        counts of a sequence: a backend may pick its work from them without a device-to-host
        copy. Returns ``[num_tokens, num_heads, head_dim]`` in the queries' dtype.
        """
        ...

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Scatter ``key``/``value`` (``[num_tokens, num_kv_heads, head_dim]``) into the cache
        slots ``slot_mapping`` (int64), as ``to_cache`` holds them. A slot of -1 means the
        token is not written (e.g. padding, or K/V already in the cache)."""
        ...

    def copy_blocks(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: torch.Tensor
    ) -> None:
        """Copy whole blocks ``pairs[:, 0] -> pairs[:, 1]`` in every layer (copy-on-write:
        a destination is never also a source)."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of ``x``'s last dimension, times ``weight``."""
        ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x + residual), x + residual)``: a layer's residual add and the next
        norm."""
        ...

    def rotary_embedding(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` and ``k`` (``[num_tokens, num_heads, head_dim]``) rotated by each token's
        angles (``cos``/``sin``: ``[num_tokens, head_dim]``, the two halves equal)."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``x = [gate | up]`` (``[num_tokens, 2 * size]``)."""
        ...

    def quant_linear(
        self,
        x: torch.Tensor,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None,
        bits: int,
        group_size: int,
    ) -> torch.Tensor:
        """``x @ W.T`` (``x``: ``[..., K]``) of the quantized weight ``W``, in ``x``'s
        dtype."""
        ...
