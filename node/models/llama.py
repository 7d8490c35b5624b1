"""The Llama-family decoder, which also covers Mistral (sliding window), Qwen2 (q/k/v bias) and
Qwen3 (per-head q/k RMSNorm), over a paged KV cache.

Module and parameter names follow the Hugging Face checkpoints, except that q/k/v and gate/up
are fused (``qkv_proj``, ``gate_up_proj``); the loader maps one layout onto the other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.kernels.backend import KernelOps
from pagedllm.models.attention_metadata import AttentionMetadata
from pagedllm.models.layers import (
    ColumnParallelLinear,
    GatedMLP,
    PackableLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabEmbedding,
)

if TYPE_CHECKING:
    from pagedllm.models.config import ModelConfig
    from pagedllm.models.decode_graph import DecodeGraph

KVCache = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, ops: KernelOps, tp_size: int) -> None:
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
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops)
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
        q, k = self.ops.rotary_embedding(q, k, *rotary)
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
    def __init__(self, config: ModelConfig, layer: int, ops: KernelOps, tp_size: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer, ops, tp_size)
        self.mlp = GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            bias=config.mlp_bias,
            tp_size=tp_size,
            ops=ops,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual stream)``: the layer's output is their sum, which the next
        norm adds (``x`` is the embeddings and ``residual`` None at the first layer)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, rotary, kv_cache, meta)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    # Runs the layers of decode steps in one call where set (``decode_graph.build``).
    decode_graph: DecodeGraph | None = None

    def __init__(self, config: ModelConfig, ops: KernelOps, tp_size: int) -> None:
        super().__init__()
        self.ops = ops
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(
            DecoderLayer(config, layer, ops, tp_size) for layer in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rotary = self.rotary_emb(positions, x.dtype)
        graph = self.decode_graph
        if graph is not None and graph.covers(x, kv_caches, meta):
            return graph.run(x, rotary, kv_caches, meta)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rotary, kv_cache, meta)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm.add_forward(x, residual)[0]


class CausalLM(nn.Module):
    """Decoder plus language-model head; one tensor-parallel rank's share of it.

    Each rank holds ``1/tp_size`` of the query heads, KV heads and MLP width; embeddings and
    the head are replicated. ``kv_caches[i]`` is layer ``i``'s ``(k_cache, v_cache)`` for this
    rank's KV heads.
    """

    def __init__(
        self, config: ModelConfig, ops: KernelOps, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__()
        config.check_tensor_parallel(tp_size)
        self.config = config
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.ops = ops
        self.model = DecoderModel(config, ops, tp_size)
        # A tied head shares the embedding's weight (``tie_weights``), or its quantized table;
        # packed for oneDNN it becomes a copy of its own, since a lookup cannot read the packed
        # layout: at decode batches the packed head runs 2-3x faster than ``F.linear`` over the
        # dense embedding.
        self.lm_head = PackableLinear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states ``[num_tokens, hidden_size]`` of a varlen batch."""
        return self.model(input_ids, positions, kv_caches, meta)

    def tie_weights(self) -> None:
        """Make a tied head share the embedding's weight; to be called again after the
        parameters are moved or materialized (``to_empty`` gives each its own tensor)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
            if self.model.embed_tokens.quantized is not None:
                self.lm_head.set_quantized(self.model.embed_tokens.quantized, self.ops)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[num_rows, vocab_size]`` float32 logits of the rows of ``hidden`` to sample from."""
        return self.lm_head(hidden).float()
