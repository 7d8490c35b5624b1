"""The adapters requests may name, as the scheduler keeps them: those of ``--lora-modules``,
and those loaded or unloaded while the node runs (``/v1/load_lora_adapter``). An adapter is
checked from its files (its config and its tensors' shapes, no weight read) before it is
added, so that one that cannot serve the model is refused with the problem named and nothing
running is disturbed; the workers load its weights when a request first uses it."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.lora.peft_files import Shapes, check_adapter


@dataclass
class LoRARegistry:
    max_rank: int
    shapes: Shapes  # the model's projections
    reserved: tuple[str, ...] = ()  # the base model's names
    adapters: dict[str, str] = field(default_factory=dict)  # name -> directory

    def load(self, name: str, path: str) -> tuple[int, str]:
        """HTTP status and message of adding ``name`` (vLLM's wording)."""
        if not name or not path:
            return 400, "lora_name and lora_path must not be empty"
        if name in self.adapters or name in self.reserved:
            return 400, f"The lora adapter '{name}' has already been loaded."
        try:
            check_adapter(name, path, self.max_rank, self.shapes)
        except ValueError as error:
            return 400, f"cannot load LoRA adapter '{name}': {error}"
        self.adapters[name] = path
        return 200, f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: str) -> tuple[int, str]:
        if self.adapters.pop(name, None) is None:
            return 404, f"The lora adapter '{name}' cannot be found."
        return 200, f"Success: LoRA adapter '{name}' removed successfully."
