"""A worker's adapters: loaded and dropped as the step plans say (the scheduler keeps the LRU of
``max_cpu_loras``, ``core.adapter_lru``), and each step's active set (at most ``max_loras``)
handed to the model's linear layers."""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from pagedllm.core.lora_request import LoRARequest, adapter_plan_problem
from pagedllm.lora.adapter import LoRAWeights, load_adapter
from pagedllm.lora.layers import LoRAContext, LoRALinear
from pagedllm.lora.peft_files import AdapterFiles, check_adapter

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
        # (name, directory) -> weights; which are held is the scheduler's call (``follow``).
        self.loaded: dict[tuple[str, str], LoRAWeights] = {}
        # Adapters checked ahead of their load (``check``) -> their files.
        self._checked: dict[tuple[str, str], AdapterFiles] = {}
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

    def check(self, request: LoRARequest) -> None:
        """Check the adapter's files against the model now (``ValueError`` naming what is
        wrong), so that a request the offline engine takes never fails inside a step."""
        if request.key not in self.loaded and request.key not in self._checked:
            self._checked[request.key] = check_adapter(
                request.lora_name, request.lora_path, self.max_lora_rank, self.shapes
            )

    def follow(self, drops: list[tuple[str, str]], loads: list[LoRARequest]) -> None:
        """Drop, then load, the adapters the scheduler's LRU (``core.adapter_lru``) chose for
        this step. The scheduler alone decides, so that what it reports loaded is what is: a
        plan that drops an adapter not held, loads one held, or leaves more than
        ``max_cpu_loras`` loaded means the two disagree, and is refused (``ValueError``)."""
        problem = adapter_plan_problem(*self.held(), drops, loads)
        if problem is not None:
            raise ValueError(problem)
        for key in drops:
            del self.loaded[key]
            log.info("LoRA adapter %s dropped from memory (--max-cpu-loras)", key[0])
        for request in loads:
            self.loaded[request.key] = self._load(request)

    def held(self) -> tuple[set[tuple[str, str]], int]:
        """The adapters loaded, and how many fit (a worker's plan check takes both)."""
        return set(self.loaded), self.max_cpu_loras

    def _load(self, request: LoRARequest) -> LoRAWeights:
        path = request.lora_path
        files = self._checked.pop(request.key, None) or check_adapter(
            request.lora_name, path, self.max_lora_rank, self.shapes
        )
        weights = load_adapter(path, files, self.dtype)
        self.num_loads += 1
        log.info("LoRA adapter %s loaded from %s", request.lora_name, path)
        return weights

    def prepare(self, tokens: list[tuple[LoRARequest | None, int]], device: torch.device) -> None:
        """Set the step's adapters: ``tokens`` gives, in batch order, each sequence's adapter
        (or None) and its number of tokens."""
        slot_of: dict[tuple[str, str], int] = {}  # adapter key -> its slot, in first-seen order
        active: list[LoRARequest] = []
        for request, _ in tokens:
            if request is not None and request.key not in slot_of:
                slot_of[request.key] = len(active)
                active.append(request)
        if len(active) > self.max_loras:
            raise ValueError(f"a step with {len(active)} adapters; at most {self.max_loras}")
        missing = [r.lora_name for r in active if r.key not in self.loaded]
        if missing:
            raise ValueError(f"a step runs adapters the plan never loaded: {missing}")
        ctx = self.context
        adapters = tuple(self.loaded[request.key] for request in active)
        if len(adapters) != len(ctx.adapters) or any(
            a is not b for a, b in zip(adapters, ctx.adapters, strict=True)
        ):
            ctx.adapters = adapters
            ctx.rank = max((a.rank for a in adapters), default=0)
            ctx.version += 1
        if not active or (len(active) == 1 and all(r is not None for r, _ in tokens)):
            ctx.one_hot = ctx.runs = None  # no adapter, or every token has the one adapter
            return
        ctx.assign(
            [(-1 if r is None else slot_of[r.key], n) for r, n in tokens], self.dtype, device
        )
