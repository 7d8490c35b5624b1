"""Which LoRA adapters the workers hold loaded: an LRU of ``max_cpu_loras``, owned by the
scheduler.

The scheduler decides each load and each drop and sends them in the step plan
(``StepPlan.lora_loads`` / ``lora_drops``); the workers only follow. So the process that
publishes the node's KV-events feed knows which adapters are loaded without asking the
workers, and a router can send a request where its adapter needs no load.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedllm.core.lora_request import LoRARequest

AdapterKey = tuple[str, str]  # LoRARequest.key: (name, directory)


@dataclass
class AdapterLRU:
    capacity: int
    # Adapter key -> the request that loaded it, least recently used first.
    held: OrderedDict[AdapterKey, LoRARequest] = field(default_factory=OrderedDict)
    num_loads: int = 0

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"an adapter LRU holds at least one adapter, got {self.capacity}")

    def use(self, adapters: Iterable[LoRARequest]) -> tuple[list[LoRARequest], list[AdapterKey]]:
        """Mark one step's ``adapters`` used: those to load, and those to drop first (the least
        recently used beyond ``capacity``, never one of this step's). A step's adapters are
        at most ``max_loras`` <= ``capacity``, so room is always found."""
        step: dict[AdapterKey, LoRARequest] = {a.key: a for a in adapters}
        if len(step) > self.capacity:
            raise ValueError(f"a step with {len(step)} adapters; {self.capacity} fit loaded")
        loads = [a for key, a in step.items() if key not in self.held]
        for key, adapter in step.items():
            self.held[key] = adapter
            self.held.move_to_end(key)
        drops: list[AdapterKey] = []
        while len(self.held) > self.capacity:
            key, _ = self.held.popitem(last=False)
            drops.append(key)
        # A drop of one loaded this very step cannot happen: this step's keys are the most
        # recent, and there are no more of them than the capacity.
        self.num_loads += len(loads)
        return loads, drops

    def loaded(self) -> list[AdapterKey]:
        """The keys held, least recently used first."""
        return list(self.held)
