"""A decode step's decoder layers as one C++ call, where the model allows it.

In a decode step (one new token per sequence) each layer is the same dozen operations; from
Python they are a dozen operator calls and as many module calls a layer. Run from C++ instead,
a step saves more than the interpreter's own time: the operators themselves ran slower with
Python between them (the measurements: ``docs/design/kernels.md``). ``decode_layers``
(``kernels/src/csrc/decode_graph_cpu.cpp``) runs every layer from C++ through the same ops, so
its results are the eager forward's. It is what vLLM's CPU backend gets from compiling its
forward with ``torch.compile``, without a compile at start-up: the library is built with the
other CPU kernels, once per machine.

It covers the CPU backend with weights in float32 panels (``cpu_linear``) or kept quantized
(``--quantization gguf`` or ``int8``), one rank, no LoRA adapters; prompts, mixed steps and
every other model run the eager modules. ``enforce_eager`` (vLLM's ``--enforce-eager``) turns
it off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedllm.kernels import cpu_extension, cpu_ops
from pagedllm.models.attention_metadata import AttentionMetadata

if TYPE_CHECKING:
    from pagedllm.models.layers import PackableLinear
    from pagedllm.models.llama import DecoderModel, KVCache


# A projection's kind, as the C++ graph reads it.
PANELS, QUANTIZED = 0, 1


@dataclass(frozen=True)
class DecodeGraph:
    """The tensors and sizes ``decode_layers`` takes, gathered once from a loaded model."""

    norms: list[torch.Tensor]  # per layer: input, post-attention
    # Per layer, each of qkv, o, gate/up, down:
    weights: list[torch.Tensor]  # panels, or the quantized values
    scales: list[torch.Tensor | None]
    mins: list[torch.Tensor | None]
    biases: list[torch.Tensor | None]
    linears: list[int]  # kind, bits, group size
    qk_norms: list[torch.Tensor | None]  # per layer: q, k
    shape: list[int]  # heads, KV heads, head_dim, hidden, qkv and gate/up out_features
    windows: list[int]  # per layer, 0 for none
    eps: float
    scale: float
    final_norm: torch.Tensor

    def covers(self, x: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata) -> bool:
        """Whether this step is one the graph runs: a token per sequence, activations in the
        norms' dtype, caches in theirs or in 8-bit floats."""
        return (
            meta.max_seqlen_q == 1
            and x.shape[0] == meta.seq_lens_k.shape[0]
            and x.dtype == self.final_norm.dtype
            and meta.slot_mapping.dtype == torch.long
            and all(k.dtype in (x.dtype, *cpu_ops.EIGHT_BIT) for k, _ in kv_caches)
        )

    def run(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The final hidden states of a decode step; ``x`` (the embeddings) is overwritten."""
        return torch.ops.pagedllm_cpu.decode_layers(
            x,
            *rotary,
            self.norms,
            self.weights,
            self.scales,
            self.mins,
            self.biases,
            self.linears,
            self.qk_norms,
            [k for k, _ in kv_caches],
            [v for _, v in kv_caches],
            meta.block_tables,
            meta.seq_lens_k,
            meta.slot_mapping,
            self.shape,
            self.windows,
            self.eps,
            self.scale,
            self.final_norm,
        )


Projection = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, list[int]]


def _projection(linear: PackableLinear) -> Projection | None:
    """``(weight, scales, mins, [kind, bits, group size])`` of a projection the graph runs as
    ``linear`` would, or None."""
    if linear.lora is not None:
        return None
    q = linear.quantized
    if q is not None:
        if linear.quant_ops is not cpu_ops:
            return None
        return q.qweight, q.scales, q.mins, [QUANTIZED, q.bits, q.group_size]
    packed = linear.packed
    if packed is not None and packed.panels:
        return packed.data, None, None, [PANELS, 0, 0]
    return None


def build(model: DecoderModel) -> DecodeGraph | None:
    """The graph of ``model``, or None where it runs eager only (another backend, a matmul
    neither in panels nor quantized, tensor parallelism, adapters)."""
    if model.ops is not cpu_ops or not cpu_extension.load():
        return None
    eps, dtype = model.norm.eps, model.norm.weight.dtype
    norms: list[torch.Tensor] = []
    projections: list[Projection] = []
    biases: list[torch.Tensor | None] = []
    qk_norms: list[torch.Tensor | None] = []
    windows: list[int] = []
    shapes = set()
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        found = [_projection(linear) for linear in linears]
        layer_norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if attn.q_norm is not None:
            layer_norms += [attn.q_norm, attn.k_norm]
        if (
            any(p is None for p in found)
            or any(n.eps != eps or n.weight.dtype != dtype for n in layer_norms)
            or attn.o_proj.tp_size != 1
            or mlp.down_proj.tp_size != 1
        ):
            return None
        projections += [p for p in found if p is not None]
        norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        biases += [linear.bias for linear in linears]
        qk_norms += (
            [None, None] if attn.q_norm is None else [attn.q_norm.weight, attn.k_norm.weight]
        )
        windows.append(attn.sliding_window or 0)
        shapes.add(
            (
                attn.num_heads,
                attn.num_kv_heads,
                attn.head_dim,
                attn.o_proj.out_features,
                attn.qkv_proj.out_features,
                mlp.gate_up_proj.out_features,
                attn.scale,
            )
        )
    if len(shapes) != 1:
        return None
    *shape, scale = shapes.pop()
    return DecodeGraph(
        norms=norms,
        weights=[p[0] for p in projections],
        scales=[p[1] for p in projections],
        mins=[p[2] for p in projections],
        biases=biases,
        linears=[i for p in projections for i in p[3]],
        qk_norms=qk_norms,
        shape=shape,
        windows=windows,
        eps=eps,
        scale=scale,
        final_norm=model.norm.weight,
    )
