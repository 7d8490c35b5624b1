"""A PEFT LoRA adapter's files read without torch: ``adapter_config.json`` and the header of
``adapter_model.safetensors`` (tensor names and shapes), enough to check an adapter against a
model before any process loads its weights (the scheduler and the API servers load no torch).

Each adapted projection ``W`` (``[out, in]``) of layer ``i`` has ``lora_A`` (``[r, in]``) and
``lora_B`` (``[out, r]``); the layer computes ``W x + s * B (A x)`` with ``s = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``). What the engine cannot run as PEFT would
(biases, DoRA, extra trained modules, per-module alphas or ranks, ranks above ``max_rank``,
tensors of other modules or shapes) is refused with a ``ValueError`` that names the problem.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections of the decoder layers an adapter may adapt (Hugging Face's Llama names).
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
    r"\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# A safetensors header larger than this is not an adapter's (its JSON lists the tensors).
MAX_HEADER_BYTES = 64 << 20

Shapes = dict[tuple[int, str], tuple[int, int]]  # (layer, module) -> (in, out) features


@dataclass(frozen=True)
class AdapterFiles:
    """What an adapter directory holds: its rank, the scale of its products, and for each
    (layer, module) it adapts, the projection's (in, out) features."""

    rank: int
    scale: float
    shapes: Shapes


def read_config(directory: Path, max_rank: int) -> tuple[int, float]:
    """The adapter's rank and scale, from its config."""
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise ValueError(f"{directory} has no {CONFIG_FILE}: not a PEFT adapter") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
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


def tensor_key(name: str) -> tuple[int, str, str]:
    """``(layer, module, "A" or "B")`` of a tensor name PEFT writes."""
    match = _TENSOR.match(name)
    if match is None or match.group(2) not in MODULES:
        raise ValueError(f"the adapter has a tensor the engine cannot apply: {name}")
    return int(match.group(1)), match.group(2), match.group(3)


def pair_shapes(halves: dict[tuple[int, str], dict[str, list[int]]], rank: int) -> Shapes:
    """(in, out) of each (layer, module) from its A and B shapes, checked against ``rank``."""
    shapes: Shapes = {}
    for (layer, module), pair in sorted(halves.items()):
        where = f"layer {layer} {module}"
        if set(pair) != {"A", "B"}:
            raise ValueError(f"the adapter has lora_A or lora_B alone for {where}")
        a, b = pair["A"], pair["B"]
        if len(a) != 2 or len(b) != 2 or a[0] != rank or b[1] != rank:
            raise ValueError(f"{where}: lora_A {a} and lora_B {b} are not of rank {rank}")
        shapes[(layer, module)] = (a[1], b[0])
    if not shapes:
        raise ValueError("the adapter adapts no module")
    return shapes


def read_header(path: Path) -> dict[str, tuple[str, list[int]]]:
    """Each tensor's (dtype, shape) from a safetensors file's header."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > MAX_HEADER_BYTES:
                raise ValueError(f"{path}: a safetensors header of {size} bytes")
            header = json.loads(f.read(size))
    except FileNotFoundError:
        raise ValueError(f"{path.parent} has no {path.name}") from None
    except (OSError, struct.error, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: not a safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"cannot read {path}: not a safetensors file")
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(type(d) is int for d in shape):
            raise ValueError(f"cannot read {path}: tensor {name} has no shape")
        tensors[name] = (str(entry.get("dtype")), shape)
    return tensors


def inspect_adapter(path: str, max_rank: int) -> AdapterFiles:
    """The adapter at ``path`` as its files describe it, checked without loading a weight."""
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"no LoRA adapter directory at {path}")
    rank, scale = read_config(directory, max_rank)
    halves: dict[tuple[int, str], dict[str, list[int]]] = {}
    for name, (dtype, shape) in read_header(directory / WEIGHTS_FILE).items():
        layer, module, half = tensor_key(name)
        if dtype not in _FLOAT_DTYPES or len(shape) != 2:
            raise ValueError(f"{name} must be a float matrix, got {dtype} {shape}")
        halves.setdefault((layer, module), {})[half] = shape
    return AdapterFiles(rank, scale, pair_shapes(halves, rank))


def check_adapter(name: str, path: str, max_rank: int, model: Shapes) -> AdapterFiles:
    """The adapter at ``path`` as its files describe it, checked against the model's
    projections (``ValueError`` naming the problem)."""
    files = inspect_adapter(path, max_rank)
    check_shapes(name, files.shapes, model)
    return files


def check_shapes(name: str, adapter: Shapes, model: Shapes) -> None:
    """``ValueError`` unless every product of the adapter fits a projection of the model."""
    for (layer, module), (fan_in, fan_out) in adapter.items():
        expected = model.get((layer, module))
        if expected is None:
            raise ValueError(
                f"adapter {name!r} adapts layer {layer} {module}, which the model does not "
                f"have (it adapts {', '.join(MODULES)} of its layers)"
            )
        if (fan_in, fan_out) != expected:
            raise ValueError(
                f"adapter {name!r}: layer {layer} {module} maps {fan_in} -> {fan_out} "
                f"features, the model's {expected[0]} -> {expected[1]}"
            )


def model_shapes(
    num_layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int
) -> Shapes:
    """``(layer, module) -> (in, out)`` of a Llama-family decoder's projections."""
    per_layer = {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, intermediate),
        "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
    }
    return {(i, m): shape for i in range(num_layers) for m, shape in per_layer.items()}
