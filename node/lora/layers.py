"""The active adapters' products, added to a linear layer's output for a whole batch at once.

A step runs up to ``max_loras`` adapters, each token with one of them or none. For a layer
whose output packs sub-projections (``qkv_proj``: q, k, v; ``gate_up_proj``: gate, up), the A
matrices of every active adapter and sub-projection are stacked, transposed, into one
``[in, subs * S * R]`` matrix (S active adapters, R their largest rank, smaller ranks padded
with zeros; each sub-projection's columns together, so that its part of a product is a plain
column slice) and the B matrices of each sub-projection into one ``[S * R, out_m]``. The
stacks are rebuilt only when the set of active adapters changes.

A step of short runs of tokens per adapter (decoding: one token a sequence) reads every
active adapter's weights once, whatever the mix:

    xa = x @ A_stacked                    one matmul for all adapters: [T, subs * S * R]
    xa *= token's adapter one-hot         each token keeps its own adapter's columns
    out[:, sub m] += xa[:, m] @ B_m       one matmul per sub-projection

which is two products per layer and no loop over adapters; the other slots' columns cost
arithmetic only, and at a few rows the products are bound by the weights' bytes, which are
the same. A step of long runs (prompts) would pay S times the arithmetic that way, so it
multiplies each run of consecutive tokens of one adapter (a sequence's prompt, or neighbours
with the same adapter) by that adapter's columns alone, in place in the rows of the run: the
segmented products of Punica/S-LoRA, with no gather or scatter since a sequence's tokens are
consecutive in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.lora.adapter import LoRAWeights

# Runs of at least this many tokens on average take the segmented products: below it the
# dense form's wasted arithmetic costs less than the segments' operator calls.
RUN_TOKENS = 16


@dataclass
class LoRAContext:
    """What a step's linear layers share: the active adapters in slot order, their largest
    rank, and which token has which slot: a one-hot ``[T, S]`` for a step of short runs, or the
    runs themselves (``runs``: slot, first token, end) for a step of long ones. Both None when
    every token has slot 0."""

    adapters: tuple[LoRAWeights, ...] = ()
    rank: int = 0
    one_hot: torch.Tensor | None = None
    runs: tuple[tuple[int, int, int], ...] | None = None
    version: int = 0  # bumped when the adapters change, so that the layers rebuild their stacks

    def assign(
        self, sequences: list[tuple[int, int]], dtype: torch.dtype, device: torch.device
    ) -> None:
        """Each sequence's slot (-1: no adapter) and number of tokens, in batch order: the
        one-hot (in the activations' ``dtype``) or the runs the layers read."""
        runs: list[tuple[int, int, int]] = []
        start = 0
        for slot, n in sequences:
            if slot >= 0 and n > 0:
                if runs and runs[-1][0] == slot and runs[-1][2] == start:
                    runs[-1] = (slot, runs[-1][1], start + n)
                else:
                    runs.append((slot, start, start + n))
            start += n
        if len(runs) * RUN_TOKENS <= start:
            self.one_hot, self.runs = None, tuple(runs)
            return
        index = torch.tensor([slot for slot, n in sequences for _ in range(n)])
        one_hot = torch.zeros(start, len(self.adapters), dtype=dtype)
        has = index >= 0
        one_hot[has.nonzero()[:, 0], index[has]] = 1
        self.one_hot, self.runs = one_hot.to(device), None


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
    # [in, subs * S * R], transposed once: a product with a transposed view of [.., in] took
    # twice as long at decode shapes.
    _a: torch.Tensor | None = None
    _b: list[torch.Tensor] = field(default_factory=list)  # per sub-projection, [S * R, out_m]

    def _stack(self, dtype: torch.dtype, device: torch.device) -> None:
        ctx = self.context
        slots, rank = len(ctx.adapters), ctx.rank
        a = torch.zeros(len(self.modules), slots, rank, self.in_features, dtype=dtype)
        bs = [torch.zeros(slots * rank, out, dtype=dtype) for out in self.out_sizes]
        for s, adapter in enumerate(ctx.adapters):
            for m, module in enumerate(self.modules):
                pair = adapter.modules.get((self.layer, module))
                if pair is None:
                    continue
                lora_a, lora_b = pair
                r = lora_a.shape[0]
                a[m, s, :r] = lora_a
                bs[m][s * rank : s * rank + r] = lora_b.T
        self._a = a.reshape(-1, self.in_features).T.contiguous().to(device)
        self._b = [b.to(device) for b in bs]
        self._version = ctx.version

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (this layer's base output for ``x``) plus the adapters' products."""
        ctx = self.context
        if not ctx.adapters:
            return out
        if self._version != ctx.version:
            self._stack(x.dtype, x.device)
        if ctx.runs is not None:
            return self._add_runs(x, out, ctx.runs)
        assert self._a is not None
        tokens, slots, subs, rank = x.shape[0], len(ctx.adapters), len(self.modules), ctx.rank
        xa = x @ self._a
        if ctx.one_hot is not None:
            xa.view(tokens, subs, slots, rank).mul_(ctx.one_hot[:, None, :, None])
        start, cols = 0, slots * rank
        for m, b in enumerate(self._b):
            size = self.out_sizes[m]
            out[:, start : start + size].addmm_(xa[:, m * cols : (m + 1) * cols], b)
            start += size
        return out

    def _add_runs(
        self, x: torch.Tensor, out: torch.Tensor, runs: tuple[tuple[int, int, int], ...]
    ) -> torch.Tensor:
        assert self._a is not None
        rank = self.context.rank
        cols = len(self.context.adapters) * rank
        for slot, first, end in runs:
            rows = x[first:end]
            start = 0
            for m, b in enumerate(self._b):
                size, a = self.out_sizes[m], m * cols + slot * rank
                out[first:end, start : start + size].addmm_(
                    rows @ self._a[:, a : a + rank], b[slot * rank : (slot + 1) * rank]
                )
                start += size
        return out
