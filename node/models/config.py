"""What the engine needs to know about a checkpoint, read and checked from its ``config.json``.

Both layouts of the rotary settings are read: ``rope_theta`` + ``rope_scaling`` (transformers
4.x) and ``rope_parameters`` (transformers 5.x).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.models import SUPPORTED_ARCHITECTURES, ModelLoadError
from pagedllm.models.layers import LinearRopeScaling, Llama3RopeScaling, RopeScaling

DEFAULT_ROPE_THETA = 10000.0
# Qwen2/Qwen3 with use_sliding_window: layers from this index on use the window.
DEFAULT_MAX_WINDOW_LAYERS = 28


@dataclass(frozen=True)
class ModelConfig:
    model_dir: Path
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    attention_bias: bool  # on the q/k/v projections
    attention_output_bias: bool  # on o_proj
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    sliding_window_layers: tuple[bool, ...]  # per layer: does the window apply
    bos_token_id: int | None
    eos_token_ids: list[int]
    torch_dtype: str | None
    # Set when the weights come from a GGUF file (in ``model_dir``) rather than safetensors.
    gguf_file: Path | None = None

    def layer_sliding_window(self, layer: int) -> int | None:
        return self.sliding_window if self.sliding_window_layers[layer] else None

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Raise ``ModelLoadError`` unless heads, KV heads and the MLP split evenly."""
        if tp_size < 1:
            raise ModelLoadError(f"tensor-parallel size must be at least 1, got {tp_size}")
        for name, count in (
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("intermediate_size", self.intermediate_size),
        ):
            if count % tp_size:
                raise ModelLoadError(
                    f"tensor-parallel size {tp_size} does not divide {name}={count} "
                    f"of {self.model_dir}"
                )

    def num_heads_per_rank(self, tp_size: int) -> int:
        self.check_tensor_parallel(tp_size)
        return self.num_attention_heads // tp_size

    def num_kv_heads_per_rank(self, tp_size: int) -> int:
        self.check_tensor_parallel(tp_size)
        return self.num_key_value_heads // tp_size


def read_model_config(model_dir: str | Path) -> ModelConfig:
    """The config of a Hugging Face model directory, or of a GGUF file (or a directory holding
    exactly one)."""
    from pagedllm.models.gguf import find_gguf_file, read_gguf_config

    gguf_file = find_gguf_file(model_dir)
    if gguf_file is not None:
        return read_gguf_config(gguf_file)
    directory = Path(model_dir).expanduser()
    if not directory.is_dir():
        raise ModelLoadError(f"model directory {directory} does not exist")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(
            f"{config_path} not found: not a Hugging Face model directory (nor one holding a "
            "GGUF file)"
        )
    generation_path = directory / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.is_file() else {}
    return parse_model_config(_read_json(config_path), generation, directory)


def parse_model_config(
    raw: dict[str, Any], generation: dict[str, Any], model_dir: Path, source: Path | None = None
) -> ModelConfig:
    """Validate a parsed ``config.json`` (and ``generation_config.json``, may be empty);
    ``source`` is the file errors name, ``config.json`` unless given."""
    fields = _Fields(raw, source or model_dir / "config.json")
    architecture = _architecture(raw, model_dir)
    hidden_size = fields.positive_int("hidden_size")
    num_heads = fields.positive_int("num_attention_heads")
    num_kv_heads = fields.positive_int("num_key_value_heads", num_heads)
    if num_heads % num_kv_heads:
        raise ModelLoadError(
            f"num_attention_heads={num_heads} is not a multiple of "
            f"num_key_value_heads={num_kv_heads} in {fields.source}"
        )
    num_layers = fields.positive_int("num_hidden_layers")
    # Mistral and Qwen hard-code their biases, whatever config.json says.
    configurable_bias = architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM")
    attention_bias = configurable_bias and fields.boolean("attention_bias", False)
    rope_theta, rope_scaling = _rope(raw, fields.source)
    sliding_window, sliding_window_layers = _sliding_window(raw, fields, architecture, num_layers)
    return ModelConfig(
        model_dir=model_dir,
        architecture=architecture,
        hidden_size=hidden_size,
        intermediate_size=fields.positive_int("intermediate_size"),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=fields.positive_int("head_dim", hidden_size // num_heads),
        vocab_size=fields.positive_int("vocab_size"),
        max_position_embeddings=fields.positive_int("max_position_embeddings"),
        rms_norm_eps=fields.positive_float("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=fields.boolean("tie_word_embeddings", False),
        attention_bias=architecture == "Qwen2ForCausalLM" or attention_bias,
        attention_output_bias=attention_bias,
        mlp_bias=architecture == "LlamaForCausalLM" and fields.boolean("mlp_bias", False),
        qk_norm=architecture == "Qwen3ForCausalLM",
        sliding_window=sliding_window if any(sliding_window_layers) else None,
        sliding_window_layers=sliding_window_layers,
        bos_token_id=fields.optional_int("bos_token_id"),
        eos_token_ids=_eos_token_ids(raw, generation, model_dir),
        torch_dtype=_dtype_name(raw),
    )


class _Fields:
    """Typed access to a JSON object's fields, each failure naming the field and the file."""

    def __init__(self, raw: dict[str, Any], source: Path) -> None:
        self.raw = raw
        self.source = source

    def _get(self, key: str, default: Any) -> Any:
        value = self.raw.get(key)
        if value is None:
            if default is None:
                raise ModelLoadError(f"{self.source} lacks the required field {key!r}")
            return default
        return value

    def invalid(self, key: str, expected: str) -> ModelLoadError:
        return ModelLoadError(
            f"{self.source}: field {key!r} must be {expected}, got {self.raw.get(key)!r}"
        )

    def positive_int(self, key: str, default: int | None = None) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.invalid(key, "a positive integer")
        return value

    def optional_int(self, key: str) -> int | None:
        value = self.raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise self.invalid(key, "an integer or null")
        return value

    def positive_float(self, key: str, default: float | None = None) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise self.invalid(key, "a positive number")
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self.raw.get(key, default)
        value = default if value is None else value
        if not isinstance(value, bool):
            raise self.invalid(key, "true or false")
        return value


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"cannot read {path}: {error}") from error
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _architecture(raw: dict[str, Any], model_dir: Path) -> str:
    architectures = raw.get("architectures")
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if not isinstance(architectures, list) or not architectures:
        raise ModelLoadError(
            f"{model_dir / 'config.json'} names no architecture (field 'architectures'); "
            f"supported: {supported}"
        )
    architecture = architectures[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {architecture!r} in {model_dir}; supported: {supported}"
        )
    return architecture


def _rope(raw: dict[str, Any], source: Path) -> tuple[float, RopeScaling | None]:
    params: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ModelLoadError(f"{source}: field {key!r} must be an object, got {value!r}")
        params.update(value)
    params.setdefault("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA))
    fields = _Fields(params, source)
    theta = fields.positive_float("rope_theta")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, LinearRopeScaling(factor=fields.positive_float("factor"))
    if kind == "llama3":
        return theta, Llama3RopeScaling(
            factor=fields.positive_float("factor"),
            low_freq_factor=fields.positive_float("low_freq_factor"),
            high_freq_factor=fields.positive_float("high_freq_factor"),
            original_max_position_embeddings=fields.positive_int(
                "original_max_position_embeddings"
            ),
        )
    raise ModelLoadError(
        f"{source}: rope scaling type {kind!r} is not supported; supported: default, linear, llama3"
    )


def _sliding_window(
    raw: dict[str, Any], fields: _Fields, architecture: str, num_layers: int
) -> tuple[int | None, tuple[bool, ...]]:
    no_window = (None, (False,) * num_layers)
    if architecture == "LlamaForCausalLM" or raw.get("sliding_window") is None:
        return no_window
    window = fields.positive_int("sliding_window")
    if architecture == "MistralForCausalLM":
        return window, (True,) * num_layers
    if not fields.boolean("use_sliding_window", False):
        return no_window
    layer_types = raw.get("layer_types")
    if layer_types is None:
        first = fields.positive_int("max_window_layers", DEFAULT_MAX_WINDOW_LAYERS)
        return window, tuple(layer >= first for layer in range(num_layers))
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise fields.invalid("layer_types", f"a list of {num_layers} layer types")
    return window, tuple(kind == "sliding_attention" for kind in layer_types)


def _eos_token_ids(raw: dict[str, Any], generation: dict[str, Any], model_dir: Path) -> list[int]:
    """End-of-sequence ids of config.json, then those only generation_config.json adds."""
    ids: list[int] = []
    for name, source in (("config.json", raw), ("generation_config.json", generation)):
        value = source.get("eos_token_id")
        values = value if isinstance(value, list) else [] if value is None else [value]
        for token in values:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ModelLoadError(
                    f"{model_dir / name}: eos_token_id must be a token id or a list of them, "
                    f"got {value!r}"
                )
            if token not in ids:
                ids.append(token)
    return ids


def _dtype_name(raw: dict[str, Any]) -> str | None:
    value = raw.get("dtype", raw.get("torch_dtype"))
    if isinstance(value, str):
        return value.removeprefix("torch.")
    return None
