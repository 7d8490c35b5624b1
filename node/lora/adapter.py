"""A PEFT LoRA adapter's weights, loaded for a worker: checked as ``peft_files`` checks the
files, then each projection's ``(A, B)`` in the model's dtype with the scale folded into B."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from pagedllm.lora.peft_files import WEIGHTS_FILE, Shapes, inspect_adapter, tensor_key


@dataclass
class LoRAWeights:
    """One adapter's products: ``(layer, module) -> (A [r, in], B [out, r] times the scale)``."""

    rank: int
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())

    @property
    def shapes(self) -> Shapes:
        return {key: (a.shape[1], b.shape[0]) for key, (a, b) in self.modules.items()}


def load_adapter(path: str, max_rank: int, dtype: torch.dtype) -> LoRAWeights:
    """The adapter at ``path``, its scale folded into B, in ``dtype`` on the CPU."""
    files = inspect_adapter(path, max_rank)
    try:
        tensors = load_file(Path(path) / WEIGHTS_FILE)
    except (OSError, SafetensorError) as e:
        raise ValueError(f"cannot read {Path(path) / WEIGHTS_FILE}: {e}") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        layer, module, half = tensor_key(name)
        halves.setdefault((layer, module), {})[half] = tensor
    modules = {
        key: (
            halves[key]["A"].to(dtype).contiguous(),
            (halves[key]["B"].float() * files.scale).to(dtype),
        )
        for key in files.shapes
    }
    return LoRAWeights(files.rank, modules)
