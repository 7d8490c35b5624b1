"""Reading a PEFT LoRA adapter: ``adapter_config.json`` and ``adapter_model.safetensors``.

Each adapted projection ``W`` (``[out, in]``) of layer ``i`` has ``lora_A`` (``[r, in]``) and
``lora_B`` (``[out, r]``); the layer computes ``W x + s * B (A x)`` with ``s = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``). The scale is folded into ``B`` here. What the
engine cannot run as PEFT would (biases, DoRA, extra trained modules, per-module alphas, ranks
above ``max_rank``, tensors of other modules or shapes) is refused with a ``ValueError`` that
names the problem, before any request uses the adapter.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections of the decoder layers an adapter may adapt (Hugging Face's Llama names).
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
    r"\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


@dataclass
class LoRAWeights:
    """One adapter's products: ``(layer, module) -> (A [r, in], B [out, r] times the scale)``."""

    rank: int
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def _config(directory: Path, max_rank: int) -> tuple[int, float]:
    """The adapter's rank and scale, from its config."""
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise ValueError(f"{directory} has no {CONFIG_FILE}: not a PEFT adapter") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {directory / CONFIG_FILE}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{CONFIG_FILE} must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"the adapter is a {config.get('peft_type')} adapter, not LoRA")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if type(rank) is not int or rank < 1:
        raise ValueError(f"the adapter's rank r must be an int >= 1, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"the adapter's rank {rank} is above --max-lora-rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"lora_alpha must be a number, got {alpha!r}")
    refused = {
        "bias": config.get("bias", "none") not in (None, "none"),
        "use_dora": bool(config.get("use_dora")),
        "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "lora_bias": bool(config.get("lora_bias")),
    }
    unsupported = [key for key, bad in refused.items() if bad]
    if unsupported:
        raise ValueError(f"the adapter sets {', '.join(unsupported)}, which is not supported")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale)


def load_adapter(path: str, max_rank: int, dtype: torch.dtype) -> LoRAWeights:
    """The adapter at ``path``, its scale folded into B, in ``dtype`` on the CPU."""
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"no LoRA adapter directory at {path}")
    rank, scale = _config(directory, max_rank)
    try:
        tensors = load_file(directory / WEIGHTS_FILE)
    except FileNotFoundError:
        raise ValueError(f"{directory} has no {WEIGHTS_FILE}") from None
    except (OSError, SafetensorError) as e:
        raise ValueError(f"cannot read {directory / WEIGHTS_FILE}: {e}") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR.match(name)
        if match is None or match.group(2) not in MODULES:
            raise ValueError(f"the adapter has a tensor the engine cannot apply: {name}")
        layer, module, half = int(match.group(1)), match.group(2), match.group(3)
        if tensor.dim() != 2 or not tensor.is_floating_point():
            raise ValueError(f"{name} must be a float matrix, got {list(tensor.shape)}")
        halves.setdefault((layer, module), {})[half] = tensor
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), pair in sorted(halves.items()):
        where = f"layer {layer} {module}"
        if set(pair) != {"A", "B"}:
            raise ValueError(f"the adapter has lora_A or lora_B alone for {where}")
        a, b = pair["A"], pair["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(
                f"{where}: lora_A {list(a.shape)} and lora_B {list(b.shape)} are not of rank {rank}"
            )
        modules[(layer, module)] = (a.to(dtype).contiguous(), (b.float() * scale).to(dtype))
    if not modules:
        raise ValueError(f"the adapter at {path} adapts no module")
    return LoRAWeights(rank, modules)
