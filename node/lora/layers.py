"""The active adapters' products, added to a linear layer's output for a whole batch at once.

A step runs up to ``max_loras`` adapters, each token with one of them or none. For a layer
whose output packs sub-projections (``qkv_proj``: q, k, v; ``gate_up_proj``: gate, up), the A
matrices of every active adapter and sub-projection are stacked into one ``[S * subs * R, in]``
matrix (S active adapters, R their largest rank, smaller ranks padded with zeros; each slot's
rows together) and the B matrices of each sub-projection into one ``[S * R, out_m]``.

A step of few tokens (decoding) reads every active adapter's weights once, whatever the mix:

    xa = x @ A_stacked.T                  one matmul for all adapters: [T, S * subs * R]
    xa *= token's adapter one-hot         each token keeps its own adapter's columns
    out[:, sub m] += xa[:, :, m] @ B_m    one matmul per sub-projection

which is two products per layer and no loop over adapters; the other slots' columns cost
arithmetic only, and at a few rows the products are bound by the weights' bytes, which are
the same. A step of many tokens (prompts) would pay S times the arithmetic that way, so it
groups the tokens by adapter instead (the segmented products of Punica/S-LoRA): each slot's
tokens gathered, multiplied by that slot's A and B alone, added back to their rows. The stacks
are rebuilt only when the set of active adapters changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.lora.adapter import LoRAWeights

# From this many tokens in a step, products per adapter group: below it the dense form's
# wasted arithmetic costs less than one group's few more operator calls.
GROUPED_TOKENS = 128


@dataclass
class LoRAContext:
    """What a step's linear layers share: the active adapters in slot order, their largest
    rank, and which token has which slot: a one-hot ``[T, S]`` for a step of few tokens, or
    each slot's token indices (``groups``) for a step of many. Both None when every token has
    slot 0."""

    adapters: tuple[LoRAWeights, ...] = ()
    rank: int = 0
    one_hot: torch.Tensor | None = None
    groups: tuple[tuple[int, torch.Tensor], ...] | None = None  # (slot, token indices)
    version: int = 0  # bumped when the adapters change, so that the layers rebuild their stacks

    def assign(self, slots: list[int], dtype: torch.dtype, device: torch.device) -> None:
        """Each token's slot (-1: no adapter, or every token -1 or 0 with one adapter active):
        the one-hot (in the activations' ``dtype``) or the groups the layers read."""
        index = torch.tensor(slots)
        if len(slots) >= GROUPED_TOKENS:
            self.one_hot = None
            self.groups = tuple(
                (slot, (index == slot).nonzero()[:, 0].to(device))
                for slot in range(len(self.adapters))
            )
            return
        one_hot = torch.zeros(len(slots), len(self.adapters), dtype=dtype)
        has = index >= 0
        one_hot[has.nonzero()[:, 0], index[has]] = 1
        self.one_hot, self.groups = one_hot.to(device), None


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
    _a: torch.Tensor | None = None  # [S * subs * R, in]
    _b: list[torch.Tensor] = field(default_factory=list)  # per sub-projection, [S * R, out_m]

    def _stack(self, dtype: torch.dtype, device: torch.device) -> None:
        ctx = self.context
        slots, rank = len(ctx.adapters), ctx.rank
        a = torch.zeros(slots, len(self.modules), rank, self.in_features, dtype=dtype)
        bs = [torch.zeros(slots * rank, out, dtype=dtype) for out in self.out_sizes]
        for s, adapter in enumerate(ctx.adapters):
            for m, module in enumerate(self.modules):
                pair = adapter.modules.get((self.layer, module))
                if pair is None:
                    continue
                lora_a, lora_b = pair
                r = lora_a.shape[0]
                a[s, m, :r] = lora_a
                bs[m][s * rank : s * rank + r] = lora_b.T
        self._a = a.reshape(-1, self.in_features).to(device)
        self._b = [b.to(device) for b in bs]
        self._version = ctx.version

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (this layer's base output for ``x``) plus the adapters' products."""
        ctx = self.context
        if not ctx.adapters:
            return out
        if self._version != ctx.version:
            self._stack(x.dtype, x.device)
        if ctx.groups is not None:
            return self._add_grouped(x, out, ctx.groups)
        assert self._a is not None
        tokens, slots, subs, rank = x.shape[0], len(ctx.adapters), len(self.modules), ctx.rank
        xa = (x @ self._a.T).view(tokens, slots, subs, rank)
        if ctx.one_hot is not None:
            xa.mul_(ctx.one_hot[:, :, None, None])
        start = 0
        for m, b in enumerate(self._b):
            size = self.out_sizes[m]
            out[:, start : start + size].addmm_(xa[:, :, m].reshape(tokens, slots * rank), b)
            start += size
        return out

    def _add_grouped(
        self, x: torch.Tensor, out: torch.Tensor, groups: tuple[tuple[int, torch.Tensor], ...]
    ) -> torch.Tensor:
        assert self._a is not None
        subs, rank = len(self.modules), self.context.rank
        rows = subs * rank
        for slot, index in groups:
            xa = x.index_select(0, index) @ self._a[slot * rows : (slot + 1) * rows].T
            start = 0
            for m, b in enumerate(self._b):
                size = self.out_sizes[m]
                product = xa[:, m * rank : (m + 1) * rank] @ b[slot * rank : (slot + 1) * rank]
                out[:, start : start + size].index_add_(0, index, product)
                start += size
        return out
