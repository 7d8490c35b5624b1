"""The adapter a request runs with, by vLLM's names: ``LoRARequest(lora_name, lora_int_id,
lora_path)``. Pure data: the scheduler keys prefix-cache blocks by the name, and a worker loads
the adapter from the path the first time it meets the name."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``).

    The name identifies the adapter: requests with the same name share its weights and their
    prefix-cache blocks, requests with different names (or none) never share a block.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    @property
    def key(self) -> tuple[str, str]:
        """What identifies the adapter's weights and K/V: its name and its directory (a name
        unloaded and loaded again from elsewhere is another adapter)."""
        return self.lora_name, self.lora_path

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("a LoRA adapter needs a non-empty name")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("a LoRA adapter needs the path of its directory")


def adapter_plan_problem(
    held: set[tuple[str, str]],
    capacity: int,
    drops: list[tuple[str, str]],
    loads: list[LoRARequest],
) -> str | None:
    """What makes a step plan's adapter ``drops`` and ``loads`` impossible for a worker
    holding ``held`` (``LoRARequest.key``s, at most ``capacity``), or None: the scheduler's
    LRU and the worker's adapters then disagree."""
    after = set(held)
    for key in drops:
        if key not in after:
            return f"the plan drops LoRA adapter {key[0]!r} ({key[1]}), which is not loaded"
        after.remove(key)
    for request in loads:
        if request.key in after:
            return f"the plan loads LoRA adapter {request.lora_name!r} again"
        after.add(request.key)
    if len(after) > capacity:
        return f"the plan leaves {len(after)} LoRA adapters loaded; at most {capacity} fit"
    return None
