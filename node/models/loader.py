"""Build a model from a Hugging Face directory (config, safetensors weights) or a GGUF file.

Each tensor-parallel rank reads only its slices of the sharded safetensors tensors (a GGUF
tensor is de-quantized whole, then sliced). A GGUF file's quantized tensors stay quantized
(``pagedllm.models.quantized``), sliced on group boundaries.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pagedllm.kernels import kernel_ops
from pagedllm.kernels.backend import KernelOps
from pagedllm.models import (
    DTYPE_CHOICES,
    DTYPES,
    QUANTIZATION_CHOICES,
    SUPPORTED_ARCHITECTURES,
    ModelLoadError,
    cpu_linear,
)
from pagedllm.models.config import ModelConfig, read_model_config
from pagedllm.models.gguf import FLOAT_TENSOR_TYPES
from pagedllm.models.gguf_weights import GGUFCheckpoint
from pagedllm.models.layers import PackableLinear, RotaryEmbedding, VocabEmbedding
from pagedllm.models.llama import CausalLM
from pagedllm.models.quantized import (
    INT8_GROUP,
    KEPT_GGUF_TYPES,
    QuantizedWeight,
    concat_rows,
    quantize_int8,
)

log = logging.getLogger(__name__)

MODEL_CLASSES: dict[str, type[CausalLM]] = dict.fromkeys(SUPPORTED_ARCHITECTURES, CausalLM)
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}
INDEX_FILE = "model.safetensors.index.json"

# Fused parameters and the checkpoint tensors stacked (along rows) into them.
FUSED_SOURCES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# Weights split along their input features (columns) across tensor-parallel ranks.
ROW_PARALLEL = ("o_proj", "down_proj")


def resolve_dtype(dtype: str, config: ModelConfig) -> torch.dtype:
    """``auto`` takes the checkpoint's dtype, float32 when it names none we serve."""
    if dtype == "auto":
        return TORCH_DTYPES.get(config.torch_dtype or "", torch.float32)
    if dtype not in TORCH_DTYPES:
        raise ModelLoadError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}; got {dtype!r}")
    return TORCH_DTYPES[dtype]


def load_model(
    model_dir: str | Path,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    ops: KernelOps | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    quantization: str | None = None,
) -> tuple[CausalLM, ModelConfig]:
    """This rank's share of the model in ``model_dir``, weights loaded, in eval mode.

    ``quantization`` (``pagedllm.models.quantized``): None keeps a GGUF file's quantized
    tensors quantized and de-quantizes nothing else."""
    config = read_model_config(model_dir)
    config.check_tensor_parallel(tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ModelLoadError(f"tensor-parallel rank {tp_rank} is outside 0..{tp_size - 1}")
    torch_dtype = resolve_dtype(dtype, config)
    device = torch.device(device)
    scheme = resolve_quantization(quantization, config, device)
    ops = ops if ops is not None else kernel_ops("auto", device)
    model_class = MODEL_CLASSES[config.architecture]
    # Built on `meta` so that no memory is spent on random initialization.
    with torch.device("meta"), _default_dtype(torch_dtype):
        model = model_class(config, ops, tp_rank, tp_size)
    with _open_checkpoint(config) as checkpoint, torch.no_grad():
        if scheme == "gguf":
            assert isinstance(checkpoint, GGUFCheckpoint)
            _keep_quantized(
                model, checkpoint, config, ops, device, tp_rank, tp_size, quantization == "gguf"
            )
        model.to_empty(device=device)
        model.tie_weights()
        kept = {name for name, m in model.named_modules() if getattr(m, "quantized", None)}
        for name, param in model.named_parameters():
            if name.rpartition(".")[0] not in kept:
                param.copy_(_read_param(checkpoint, config, name, param, tp_rank, tp_size))
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_parameters()
    model.requires_grad_(False)
    if scheme == "int8":
        _quantize_int8(model, ops)
    if cpu_linear.available(device, torch_dtype):
        for module in model.modules():
            if isinstance(module, PackableLinear) and module.quantized is None:
                module.pack_weight()
    return model.eval(), config


def resolve_quantization(
    quantization: str | None, config: ModelConfig, device: torch.device
) -> str:
    """The scheme the weights are held in: ``gguf``, ``int8`` or ``none``."""
    if quantization is not None and quantization not in QUANTIZATION_CHOICES:
        raise ModelLoadError(
            f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}; got {quantization!r}"
        )
    is_gguf = config.gguf_file is not None
    if quantization == "gguf" and not is_gguf:
        raise ModelLoadError(
            f"--quantization gguf keeps a GGUF file's quantized tensors, and {config.model_dir} "
            "is not a GGUF model; --quantization int8 quantizes a float checkpoint"
        )
    scheme = quantization or ("gguf" if is_gguf and config.torch_dtype is None else "none")
    if scheme != "none" and device.type != "cpu":
        log.info(
            "quantization %s: the quantized kernels run on the CPU; on %s the weights are "
            "de-quantized into the model's dtype at load",
            scheme,
            device.type,
        )
        return "none"
    return scheme


def _keep_quantized(
    model: CausalLM,
    checkpoint: GGUFCheckpoint,
    config: ModelConfig,
    ops: KernelOps,
    device: torch.device,
    tp_rank: int,
    tp_size: int,
    explicit: bool,
) -> None:
    """Give each linear layer and the embedding whose GGUF tensors are all of a kept type its
    quantized weight (before the dense weights are allocated)."""
    dequantized = Counter[str]()
    for module_name, module in model.named_modules():
        if not isinstance(module, (PackableLinear, VocabEmbedding)):
            continue
        if module is model.lm_head and config.tie_word_embeddings:
            continue  # ``tie_weights`` shares the embedding's
        name = f"{module_name}.weight"
        sources = _sources(config, name, module.weight, tp_size)
        kinds = [checkpoint.tensor_type(source.name) for source in sources]
        if not all(kind in KEPT_GGUF_TYPES for kind in kinds):
            for kind in kinds:
                if kind not in KEPT_GGUF_TYPES and kind not in FLOAT_TENSOR_TYPES:
                    if explicit:
                        raise ModelLoadError(
                            f"--quantization gguf: tensor {name} is stored as {kind}, which "
                            f"the quantized kernels cannot take (they take "
                            f"{', '.join(KEPT_GGUF_TYPES)}); --quantization none de-quantizes "
                            "every tensor"
                        )
                    dequantized[kind] += 1
            continue
        parts = [_read_quantized(checkpoint, s, tp_rank, tp_size) for s in sources]
        weight = concat_rows(parts).to(device)
        if isinstance(module, VocabEmbedding):
            module.set_quantized(weight)
        else:
            module.set_quantized(weight, ops)
    for kind, count in sorted(dequantized.items()):
        log.info(
            "%d GGUF tensors of type %s are de-quantized at load (the quantized kernels take %s)",
            count,
            kind,
            ", ".join(KEPT_GGUF_TYPES),
        )


def _read_quantized(
    checkpoint: GGUFCheckpoint, source: _Source, tp_rank: int, tp_size: int
) -> QuantizedWeight:
    """This rank's share of a quantized GGUF tensor, split on group boundaries."""
    weight = checkpoint.quantized(source.name)
    if weight.shape != source.shape:
        raise ModelLoadError(
            f"tensor {source.name} in {checkpoint.path} has shape "
            f"{list(weight.shape)}, the config implies {list(source.shape)}"
        )
    if source.shard_dim == 0:
        size = weight.shape[0] // tp_size
        return weight.rows(slice(tp_rank * size, (tp_rank + 1) * size))
    if source.shard_dim == 1:
        size = weight.shape[1] // tp_size
        return weight.columns(tp_rank * size, (tp_rank + 1) * size)
    return weight


def _quantize_int8(model: CausalLM, ops: KernelOps) -> None:
    """Every linear layer's weight (the head's included) in int8 groups."""
    for name, module in model.named_modules():
        if not isinstance(module, PackableLinear) or module.quantized is not None:
            continue
        if module.in_features % INT8_GROUP:
            log.info(
                "%s stays in %s: %d input features are not a whole number of int8 groups",
                name,
                module.weight.dtype,
                module.in_features,
            )
            continue
        module.set_quantized(quantize_int8(module.weight).to(module.weight.device), ops)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@dataclass(frozen=True)
class _Source:
    """One checkpoint tensor feeding a parameter, and how ranks split it."""

    name: str
    shape: tuple[int, ...]  # the whole tensor's, as the config implies
    shard_dim: int | None


def _sources(
    config: ModelConfig, param_name: str, param: torch.Tensor, tp_size: int
) -> list[_Source]:
    module_name, _, kind = param_name.rpartition(".")
    parent, _, leaf = module_name.rpartition(".")
    if leaf in FUSED_SOURCES:
        if leaf == "qkv_proj":
            q_size = config.num_attention_heads * config.head_dim
            kv_size = config.num_key_value_heads * config.head_dim
            rows = (q_size, kv_size, kv_size)
        else:
            rows = (config.intermediate_size,) * 2
        return [
            _Source(f"{parent}.{source}.{kind}", (size, *param.shape[1:]), shard_dim=0)
            for source, size in zip(FUSED_SOURCES[leaf], rows, strict=True)
        ]
    if leaf in ROW_PARALLEL and kind == "weight":
        shape = (param.shape[0], param.shape[1] * tp_size)
        return [_Source(param_name, shape, shard_dim=1)]
    return [_Source(param_name, tuple(param.shape), shard_dim=None)]


def _read_param(
    checkpoint: _Checkpoint | GGUFCheckpoint,
    config: ModelConfig,
    name: str,
    param: torch.Tensor,
    tp_rank: int,
    tp_size: int,
) -> torch.Tensor:
    parts = []
    for source in _sources(config, name, param, tp_size):
        tensor = checkpoint.slice(source.name)
        shape = tuple(tensor.get_shape())
        if shape != source.shape:
            raise ModelLoadError(
                f"tensor {source.name} in {checkpoint.file_of(source.name)} has shape "
                f"{list(shape)}, the config implies {list(source.shape)}"
            )
        if source.shard_dim is None:
            parts.append(tensor[:])
            continue
        size = shape[source.shard_dim] // tp_size
        rank_slice = slice(tp_rank * size, (tp_rank + 1) * size)
        parts.append(tensor[rank_slice] if source.shard_dim == 0 else tensor[:, rank_slice])
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _open_checkpoint(config: ModelConfig) -> _Checkpoint | GGUFCheckpoint:
    if config.gguf_file is not None:
        return GGUFCheckpoint(config)
    return _Checkpoint(config.model_dir)


class _Checkpoint:
    """The safetensors files of a model directory, opened for reading by tensor name."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.file_by_tensor = _tensor_files(model_dir)
        self._stack = ExitStack()
        self._handles: dict[Path, Any] = {}

    def __enter__(self) -> _Checkpoint:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()

    def file_of(self, name: str) -> Path:
        return self.file_by_tensor[name]

    def slice(self, name: str) -> Any:
        """A lazily read view of tensor ``name`` (``get_shape()``, indexing)."""
        if name not in self.file_by_tensor:
            raise ModelLoadError(f"tensor {name} is missing from the weights in {self.model_dir}")
        path = self.file_by_tensor[name]
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(safe_open(path, framework="pt"))
        return self._handles[path].get_slice(name)


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ModelLoadError(f"cannot read the weight map of {index_path}: {error}") from error
        files = {name: model_dir / file for name, file in weight_map.items()}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise ModelLoadError(f"weight file {path} listed in {index_path} is missing")
        return files
    paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise ModelLoadError(f"no *.safetensors weight files in {model_dir}")
    files = {}
    for path in paths:
        try:
            with safe_open(path, framework="pt") as handle:
                files.update(dict.fromkeys(handle.keys(), path))
        except Exception as error:  # safetensors raises its own, undocumented error types
            raise ModelLoadError(f"cannot read weight file {path}: {error}") from error
    return files
