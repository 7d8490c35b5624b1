"""GGUF files (llama.cpp's single-file format) as a model source: finding the file, reading its
metadata, and the engine's model config from it.

Nothing here imports torch: the API servers read the tokenizer from the same metadata
(``pagedllm.models.gguf_tokenizer``); the weights are read by ``pagedllm.models.gguf_weights``.
The metadata keys are llama.cpp's (``llama.block_count``, ``tokenizer.ggml.eos_token_id``...),
mapped onto the Hugging Face config fields the way transformers' GGUF integration maps them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedllm.models import ModelLoadError

if TYPE_CHECKING:
    from pagedllm.models.config import ModelConfig
    from pagedllm.models.gguf_reader import GGUFContents
    from pagedllm.models.layers import RopeScaling

GGUF_SUFFIX = ".gguf"
# GGUF architecture (general.architecture) -> the Hugging Face architecture that serves it.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}
# ggml tensor types de-quantized at load (each checked in tests/models/test_gguf.py).
SUPPORTED_TENSOR_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
FLOAT_TENSOR_TYPES = ("F32", "F16", "BF16")
_TORCH_DTYPE_OF = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
DEFAULT_ROPE_THETA = 10000.0


def find_gguf_file(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: itself, or the one ``.gguf`` file of a directory that is
    not a Hugging Face model directory; None when ``path`` is not a GGUF model."""
    path = Path(path).expanduser()
    if path.is_file():
        return path if path.suffix.lower() == GGUF_SUFFIX else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(p for p in path.iterdir() if p.suffix.lower() == GGUF_SUFFIX and p.is_file())
    if len(files) > 1:
        names = ", ".join(p.name for p in files)
        raise ModelLoadError(
            f"{path} holds {len(files)} GGUF files ({names}); pass the one to serve as "
            f"--model {path / files[0].name}"
        )
    return files[0] if files else None


def is_gguf_model(path: str | Path) -> bool:
    return find_gguf_file(path) is not None


@dataclass
class GGUFFile:
    """An opened GGUF file: typed access to its metadata, each failure naming key and file."""

    path: Path
    contents: GGUFContents

    @classmethod
    def open(cls, path: str | Path) -> GGUFFile:
        # Imported here so that processes serving a Hugging Face directory never load it.
        from pagedllm.models.gguf_reader import read_gguf

        path = Path(path).expanduser()
        try:
            contents = read_gguf(path)
        except (OSError, ValueError) as error:  # GGUFFormatError is a ValueError
            raise ModelLoadError(f"cannot read GGUF file {path}: {error}") from error
        return cls(path, contents)

    def has(self, key: str) -> bool:
        return key in self.contents.metadata

    def value(self, key: str, default: Any = None) -> Any:
        """The value of metadata ``key`` (a str, number, bool or list), or ``default``."""
        return self.contents.metadata.get(key, default)

    def string(self, key: str, default: str | None = None) -> str:
        value = self.value(key, default)
        if not isinstance(value, str):
            raise self._invalid(key, value, "a string")
        return value

    def integer(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.value(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self._invalid(key, value, f"an integer >= {minimum}")
        return value

    def optional_integer(self, key: str) -> int | None:
        return self.integer(key, minimum=0) if self.has(key) else None

    def number(self, key: str, default: float | None = None) -> float:
        value = self.value(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise self._invalid(key, value, "a positive number")
        return float(value)

    def _invalid(self, key: str, value: Any, expected: str) -> ModelLoadError:
        if value is None:
            return ModelLoadError(f"{self.path} lacks the metadata {key!r}")
        return ModelLoadError(f"{self.path}: metadata {key!r} must be {expected}, got {value!r}")

    @cached_property
    def tensor_types(self) -> dict[str, str]:
        """``{tensor name: ggml type name}``, e.g. ``{"blk.0.attn_q.weight": "Q4_K"}``."""
        return {name: tensor.type.name for name, tensor in self.contents.tensors.items()}

    def architecture(self) -> str:
        name = self.string("general.architecture")
        if name not in GGUF_ARCHITECTURES:
            raise ModelLoadError(
                f"{self.path}: GGUF architecture {name!r} is not supported; "
                f"supported: {', '.join(GGUF_ARCHITECTURES)}"
            )
        return name

    def check_tensor_types(self) -> None:
        """Raise ``ModelLoadError`` naming the first tensor stored in a type we cannot read."""
        for name, kind in self.tensor_types.items():
            if kind not in SUPPORTED_TENSOR_TYPES:
                raise ModelLoadError(
                    f"{self.path}: tensor {name} is stored as {kind}, which PagedLLM cannot "
                    f"de-quantize; supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
                )

    def torch_dtype(self) -> str | None:
        """The file's float type when it holds no quantized tensors (its norms are F32 beside
        half-precision weights, so the half type is the model's); None otherwise."""
        kinds = set(self.tensor_types.values())
        if not kinds <= set(FLOAT_TENSOR_TYPES):
            return None
        for kind in ("BF16", "F16", "F32"):
            if kind in kinds:
                return _TORCH_DTYPE_OF[kind]
        return None


def read_gguf_config(path: str | Path) -> ModelConfig:
    """The engine's model config from a GGUF file's metadata (a Llama-architecture file)."""
    from pagedllm.models.config import parse_model_config

    file = GGUFFile.open(path)
    arch = file.architecture()
    file.check_tensor_types()
    tensors = file.tensor_types
    num_heads = file.integer(f"{arch}.attention.head_count")
    hidden_size = file.integer(f"{arch}.embedding_length")
    head_dim = file.integer(f"{arch}.attention.key_length", hidden_size // num_heads)
    if file.integer(f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise ModelLoadError(
            f"{file.path}: partial rotary embeddings ({arch}.rope.dimension_count "
            f"{file.value(f'{arch}.rope.dimension_count')} of head size {head_dim}) are not "
            "supported"
        )
    vocab_size = file.value(f"{arch}.vocab_size") or len(file.value("tokenizer.ggml.tokens", []))
    eos_ids = [
        file.optional_integer(f"tokenizer.ggml.{key}")
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
    ]
    raw = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "hidden_size": hidden_size,
        "intermediate_size": file.integer(f"{arch}.feed_forward_length"),
        "num_hidden_layers": file.integer(f"{arch}.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": file.integer(f"{arch}.attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": file.integer(f"{arch}.context_length"),
        "rms_norm_eps": file.number(f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": file.number(f"{arch}.rope.freq_base", DEFAULT_ROPE_THETA),
        "rope_scaling": _rope_scaling(file, arch),
        # llama.cpp writes no output.weight when the head shares the embedding.
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "bos_token_id": file.optional_integer("tokenizer.ggml.bos_token_id"),
        "eos_token_id": [token for token in eos_ids if token is not None],
        "torch_dtype": file.torch_dtype(),
    }
    config = parse_model_config(raw, {}, file.path.parent, source=file.path)
    factors = _rope_frequency_factors(file, head_dim)
    if factors is not None:
        if config.rope_scaling is not None:
            raise ModelLoadError(
                f"{file.path}: both rope_freqs.weight and {arch}.rope.scaling.type "
                f"{file.value(f'{arch}.rope.scaling.type')!r} scale the rotary frequencies"
            )
        config = dataclasses.replace(config, rope_scaling=factors)
    return dataclasses.replace(config, gguf_file=file.path)


def _rope_frequency_factors(file: GGUFFile, head_dim: int) -> RopeScaling | None:
    """The per-frequency divisors of ``rope_freqs.weight`` (Llama 3.1 and later), if any."""
    from gguf import quants

    from pagedllm.models.layers import FrequencyFactorRopeScaling

    tensor = file.contents.tensors.get("rope_freqs.weight")
    if tensor is None:
        return None
    factors = quants.dequantize(tensor.data, tensor.type).reshape(-1)
    if factors.shape != (head_dim // 2,) or not (factors > 0).all():
        raise ModelLoadError(
            f"{file.path}: rope_freqs.weight must hold {head_dim // 2} positive factors, "
            f"got shape {list(tensor.shape)}"
        )
    return FrequencyFactorRopeScaling(tuple(float(f) for f in factors))


def _rope_scaling(file: GGUFFile, arch: str) -> dict[str, Any] | None:
    kind = file.value(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": file.number(f"{arch}.rope.scaling.factor")}
    raise ModelLoadError(
        f"{file.path}: rope scaling type {kind!r} ({arch}.rope.scaling.type) is not supported; "
        "supported: none, linear"
    )
