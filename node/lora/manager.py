"""A worker's adapters: loaded on first use into an LRU of ``max_cpu_loras``, and each step's
active set (at most ``max_loras``) handed to the model's linear layers."""

from __future__ import annotations

import logging
import re
from collections import OrderedDict

import torch
from torch import nn

from pagedllm.lora.adapter import MODULES, LoRAWeights, load_adapter
from pagedllm.lora.layers import LoRAContext, LoRALinear
from pagedllm.lora.request import LoRARequest

log = logging.getLogger(__name__)

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# Our packed projections and the PEFT modules they hold, in output order.
PACKED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


def _out_sizes(model: nn.Module, name: str, subs: tuple[str, ...]) -> tuple[int, ...]:
    module = model.get_submodule(name)
    if len(subs) == 1:
        return (module.out_features,)
    if subs[0] == "gate_proj":
        return (module.out_features // 2, module.out_features // 2)
    attention = model.get_submodule(name.rsplit(".", 1)[0])  # q, k and v: the heads of each
    kv = attention.num_kv_heads * attention.head_dim
    return (attention.num_heads * attention.head_dim, kv, kv)


class LoRAManager:
    def __init__(
        self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int
    ) -> None:
        if max_loras < 1 or max_lora_rank < 1 or max_cpu_loras < max_loras:
            raise ValueError(
                "LoRA needs max_loras >= 1, max_lora_rank >= 1 and max_cpu_loras >= max_loras"
            )
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.dtype = next(model.parameters()).dtype
        self.context = LoRAContext()
        self.loaded: OrderedDict[str, LoRAWeights] = OrderedDict()
        # Every name met, with its path: a name means one adapter for the engine's life, since
        # the prefix cache keys blocks by it.
        self.paths: dict[str, str] = {}
        self.num_loads = 0
        # (layer, PEFT module) -> (in, out) of the projection, to check adapters against.
        self.shapes: dict[tuple[int, str], tuple[int, int]] = {}
        for name, module in model.named_modules():
            match = _LAYER.search(name)
            leaf = name.rsplit(".", 1)[-1]
            if match is None or leaf not in PACKED:
                continue
            layer, subs = int(match.group(1)), PACKED[leaf]
            sizes = _out_sizes(model, name, subs)
            module.lora = LoRALinear(self.context, layer, subs, sizes, module.in_features)
            for sub, size in zip(subs, sizes, strict=True):
                self.shapes[(layer, sub)] = (module.in_features, size)
        if not self.shapes:
            raise ValueError("the model has no projections an adapter can adapt")

    def load(self, request: LoRARequest) -> LoRAWeights:
        """The adapter's weights, loaded and checked on first use (``ValueError`` if they
        cannot serve this model), the least recently used one dropped beyond the LRU's size."""
        name = request.lora_name
        known = self.paths.get(name)
        if known is not None and known != request.lora_path:
            raise ValueError(
                f"LoRA adapter name {name!r} already names the adapter at {known}; give the "
                f"one at {request.lora_path} another name"
            )
        held = self.loaded.get(name)
        if held is not None:
            self.loaded.move_to_end(name)
            return held
        weights = load_adapter(request.lora_path, self.max_lora_rank, self.dtype)
        for (layer, module), (a, b) in weights.modules.items():
            expected = self.shapes.get((layer, module))
            if expected is None:
                raise ValueError(
                    f"adapter {request.lora_name!r} adapts layer {layer} {module}, which the "
                    f"model does not have (it adapts {', '.join(MODULES)} of its layers)"
                )
            if (a.shape[1], b.shape[0]) != expected:
                raise ValueError(
                    f"adapter {request.lora_name!r}: layer {layer} {module} maps "
                    f"{a.shape[1]} -> {b.shape[0]} features, the model's {expected[0]} -> "
                    f"{expected[1]}"
                )
        self.loaded[name] = weights
        self.paths[name] = request.lora_path
        self.num_loads += 1
        while len(self.loaded) > self.max_cpu_loras:
            dropped, _ = self.loaded.popitem(last=False)
            log.info("LoRA adapter %s dropped from memory (--max-cpu-loras)", dropped)
        log.info("LoRA adapter %s loaded from %s", name, request.lora_path)
        return weights

    def prepare(self, tokens: list[tuple[LoRARequest | None, int]], device: torch.device) -> None:
        """Set the step's adapters: ``tokens`` gives, in batch order, each sequence's adapter
        (or None) and its number of tokens."""
        names: list[str] = []
        for request, _ in tokens:
            if request is not None and request.lora_name not in names:
                names.append(request.lora_name)
        if len(names) > self.max_loras:
            raise ValueError(f"a step with {len(names)} adapters; at most {self.max_loras}")
        ctx = self.context
        if not names:
            ctx.names, ctx.adapters, ctx.one_hot = (), (), None
            return
        by_name = {r.lora_name: r for r, _ in tokens if r is not None}
        adapters = tuple(self.load(by_name[name]) for name in names)
        if tuple(names) != ctx.names or any(
            a is not b for a, b in zip(adapters, ctx.adapters, strict=True)
        ):
            ctx.names, ctx.adapters = tuple(names), adapters
            ctx.rank = max(a.rank for a in adapters)
            ctx.version += 1
        every_token_first = len(names) == 1 and all(r is not None for r, _ in tokens)
        if every_token_first:
            ctx.one_hot = None
            return
        slots = torch.tensor(
            [names.index(r.lora_name) if r is not None else -1 for r, n in tokens for _ in range(n)]
        )
        one_hot = torch.zeros(len(slots), len(names), dtype=self.dtype)
        has = slots >= 0
        one_hot[has.nonzero()[:, 0], slots[has]] = 1
        ctx.one_hot = one_hot.to(device)
