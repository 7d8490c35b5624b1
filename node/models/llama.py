"""The Llama-family decoder, which also covers Mistral (sliding window), Qwen2 (q/k/v bias) and
Qwen3 (per-head q/k RMSNorm), over a paged KV cache.

Module and parameter names follow the Hugging Face checkpoints, except that q/k/v and gate/up
are fused (``qkv_proj``, ``gate_up_proj``); the loader maps one layout onto the other.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.models.layers import (
    ColumnParallelLinear,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    apply_rotary,
)
from pagedllm.worker.attention_metadata import AttentionMetadata

if TYPE_CHECKING:
    from pagedllm.models.config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, ops: ModuleType, tp_size: int) -> None:
        super().__init__()
        self.ops = ops
        self.head_dim = config.head_dim
        self.num_heads = config.num_heads_per_rank(tp_size)
        self.num_kv_heads = config.num_kv_heads_per_rank(tp_size)
        self.scale = config.head_dim**-0.5
        self.sliding_window = config.layer_sliding_window(layer)
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size,
            (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim,
            bias=config.attention_bias,
            tp_size=tp_size,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim,
            config.hidden_size,
            bias=config.attention_output_bias,
            tp_size=tp_size,
        )
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rotary
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k_cache, v_cache = kv_cache
        self.ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = self.ops.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.cu_seqlens_q,
            meta.seq_lens_k,
            self.scale,
            self.sliding_window,
            meta.max_seqlen_q,
            meta.max_seqlen_k,
        )
        return self.o_proj(out.reshape(num_tokens, q_size))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, ops: ModuleType, tp_size: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer, ops, tp_size)
        self.mlp = GatedMLP(
            config.hidden_size, config.intermediate_size, bias=config.mlp_bias, tp_size=tp_size
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotary, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, ops: ModuleType, tp_size: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(
            DecoderLayer(config, layer, ops, tp_size) for layer in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rotary = self.rotary_emb(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rotary, kv_cache, meta)
        return self.norm(x)


class CausalLM(nn.Module):
    """Decoder plus language-model head; one tensor-parallel rank's share of it.

    Each rank holds ``1/tp_size`` of the query heads, KV heads and MLP width; embeddings and
    the head are replicated. ``kv_caches[i]`` is layer ``i``'s ``(k_cache, v_cache)`` for this
    rank's KV heads.
    """

    def __init__(
        self, config: ModelConfig, ops: ModuleType, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__()
        config.check_tensor_parallel(tp_size)
        self.config = config
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.model = DecoderModel(config, ops, tp_size)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states ``[num_tokens, hidden_size]`` of a varlen batch."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[num_rows, vocab_size]`` float32 logits of the rows of ``hidden`` to sample from."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(hidden, head.weight).float()
