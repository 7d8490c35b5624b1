"""A PEFT LoRA adapter's weights, loaded for a worker once ``peft_files`` has checked its
files: each projection's ``(A, B)`` in the model's dtype with the scale folded into B."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from pagedllm.lora.peft_files import WEIGHTS_FILE, AdapterFiles, tensor_key


@dataclass
class LoRAWeights:
    """One adapter's products: ``(layer, module) -> (A [r, in], B [out, r] times the scale)``."""

    rank: int
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def load_adapter(path: str, files: AdapterFiles, dtype: torch.dtype) -> LoRAWeights:
    """The adapter at ``path`` (its checked ``files``), its scale folded into B, in ``dtype``
    on the CPU."""
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
