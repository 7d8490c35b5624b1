"""The batched adapter products against each token's own adapter applied alone, in both forms
a step takes: the dense one-hot form of short runs (decoding) and the segmented form of long
ones (prompts)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.lora.adapter import LoRAWeights
from pagedllm.lora.layers import RUN_TOKENS, LoRAContext, LoRALinear

IN = 24
OUT = {"q_proj": 24, "k_proj": 8, "v_proj": 8}


def adapter(seed: int, rank: int, modules: tuple[str, ...]) -> LoRAWeights:
    g = torch.Generator().manual_seed(seed)
    return LoRAWeights(
        rank,
        {
            (3, m): (torch.randn(rank, IN, generator=g), torch.randn(OUT[m], rank, generator=g))
            for m in modules
        },
    )


def reference(x: torch.Tensor, slots: list[int], adapters: list[LoRAWeights]) -> torch.Tensor:
    rows = []
    for token, slot in zip(x, slots, strict=True):
        parts = []
        for m, size in OUT.items():
            pair = adapters[slot].modules.get((3, m)) if slot >= 0 else None
            parts.append(torch.zeros(size) if pair is None else pair[1] @ (pair[0] @ token))
        rows.append(torch.cat(parts))
    return torch.stack(rows)


@pytest.mark.parametrize("run", [1, RUN_TOKENS + 3], ids=["dense", "runs"])
def test_each_token_gets_its_own_adapter(run: int) -> None:
    # Ranks 4 and 8 (the smaller padded), one adapter without k and v, sequences with none,
    # and two neighbours with one adapter (one run of both).
    adapters = [
        adapter(1, 8, ("q_proj", "k_proj", "v_proj")),
        adapter(2, 4, ("q_proj", "k_proj", "v_proj")),
        adapter(3, 8, ("q_proj",)),
    ]
    sequences = [(slot, run + i % 3) for i, slot in enumerate([-1, 2, 1, 1, 0, -1, 0, 2, 1])]
    slots = [slot for slot, n in sequences for _ in range(n)]
    x = torch.randn(len(slots), IN, dtype=torch.float64)
    base = torch.randn(len(slots), sum(OUT.values()), dtype=torch.float64)
    context = LoRAContext(tuple(adapters), rank=8, version=1)
    context.assign(sequences, torch.float64, torch.device("cpu"))
    assert (context.runs is None) == (run == 1)
    assert (context.one_hot is None) == (run > 1)
    if context.runs is not None:
        assert len(context.runs) == 6  # the neighbours with slot 1 made one run
    layer = LoRALinear(context, 3, tuple(OUT), tuple(OUT.values()), IN)
    got = layer.add(x, base.clone())
    as64 = [
        LoRAWeights(a.rank, {k: (p[0].double(), p[1].double()) for k, p in a.modules.items()})
        for a in adapters
    ]
    torch.testing.assert_close(got, base + reference(x, slots, as64))
