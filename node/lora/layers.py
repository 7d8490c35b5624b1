"""The active adapters' products, added to a linear layer's output for a whole batch at once.

A step runs up to ``max_loras`` adapters, each token with one of them or none. For a layer
whose output packs sub-projections (``qkv_proj``: q, k, v; ``gate_up_proj``: gate, up), the A
matrices of every active adapter and sub-projection are stacked into one ``[subs * S * R, in]``
matrix (S active adapters, R their largest rank, smaller ranks padded with zeros) and the B
matrices of each sub-projection into one ``[out_m, S * R]``. Then, whatever the mix:

    xa = x @ A_stacked.T                  one matmul for all adapters: [T, subs * S * R]
    xa *= token's adapter one-hot         each token keeps its own adapter's columns
    out[:, sub m] += xa[:, m] @ B_m.T     one matmul per sub-projection

so a batch mixing adapters costs two matmuls per layer, with no loop over adapters (the idea of
Punica's segmented products, written as dense products over the few active adapters). The
stacks are rebuilt only when the set of active adapters changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.lora.adapter import LoRAWeights


@dataclass
class LoRAContext:
    """What a step's linear layers share: the active adapters in slot order, their largest
    rank, and each token's slot as a one-hot ``[T, S]`` (None when every token has slot 0)."""

    adapters: tuple[LoRAWeights, ...] = ()
    rank: int = 0
    one_hot: torch.Tensor | None = None
    version: int = 0  # bumped when the adapters change, so that the layers rebuild their stacks


@dataclass
class LoRALinear:
    """The adapters' part of one linear layer: ``layer``'s ``modules`` (the sub-projections,
    in output order) with their output sizes."""

    context: LoRAContext
    layer: int
    modules: tuple[str, ...]
    out_sizes: tuple[int, ...]
    in_features: int
    _version: int = -1
    _a: torch.Tensor | None = None
    _bt: list[torch.Tensor] = field(default_factory=list)  # each B, transposed

    def _stack(self, dtype: torch.dtype, device: torch.device) -> None:
        ctx = self.context
        slots, rank = len(ctx.adapters), ctx.rank
        a = torch.zeros(len(self.modules), slots, rank, self.in_features, dtype=dtype)
        bs = [torch.zeros(out, slots * rank, dtype=dtype) for out in self.out_sizes]
        for s, adapter in enumerate(ctx.adapters):
            for m, module in enumerate(self.modules):
                pair = adapter.modules.get((self.layer, module))
                if pair is None:
                    continue
                lora_a, lora_b = pair
                r = lora_a.shape[0]
                a[m, s, :r] = lora_a
                bs[m][:, s * rank : s * rank + r] = lora_b
        self._a = a.reshape(-1, self.in_features).to(device)
        self._bt = [b.to(device).T.contiguous() for b in bs]
        self._version = ctx.version

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (this layer's base output for ``x``) plus the adapters' products."""
        ctx = self.context
        if not ctx.adapters:
            return out
        if self._version != ctx.version:
            self._stack(x.dtype, x.device)
        assert self._a is not None
        tokens, slots, rank = x.shape[0], len(ctx.adapters), ctx.rank
        xa = (x @ self._a.T).view(tokens, len(self.modules), slots, rank)
        if ctx.one_hot is not None:
            xa.mul_(ctx.one_hot[:, None, :, None])
        start = 0
        for m, b in enumerate(self._bt):
            size = self.out_sizes[m]
            out[:, start : start + size].addmm_(xa[:, m].reshape(tokens, slots * rank), b)
            start += size
        return out
