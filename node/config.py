"""Engine settings, validated once at the border."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedllm.core.scheduler import SchedulerConfig
from pagedllm.core.speculative import SpeculativeConfig, parse_speculative_config
from pagedllm.kernels import BACKENDS
from pagedllm.models import DTYPE_CHOICES, QUANTIZATION_CHOICES

# The KV cache's element (vLLM's names): "auto" keeps the model's dtype; the 8-bit ones hold
# about twice a bfloat16 cache's tokens in the same memory. "fp8" is "fp8_e4m3";
# "int8_per_token_head" keeps int8 values with a scale per token and KV head (CPU backend).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head")


@dataclass
class EngineConfig:
    """Settings of one serving engine, with vLLM's names and meanings.

    ``model`` is a local Hugging Face directory, a GGUF file (or a directory holding one), or
    the name of a packaged model (``smollm2``); None means the built-in demo model.
    ``quantization`` (vLLM's name): ``gguf`` keeps a GGUF file's quantized tensors quantized
    (the default for such a file), ``int8`` quantizes float weights to int8 groups, ``none``
    de-quantizes into ``dtype``.
    ``tokenizer`` takes the tokenizer from another directory or GGUF file.
    ``kv_cache_memory`` (bytes) sizes the KV cache directly; otherwise on CUDA
    ``gpu_memory_utilization`` of the device goes to weights, activations and cache, and on
    the CPU a share of the free memory is used. ``speculative_config`` (a dict as vLLM takes
    it, or its JSON text) turns on speculative decoding.
    ``enable_lora`` serves LoRA adapters (``LoRARequest``) beside the base model: at most
    ``max_loras`` of them in one step, of rank at most ``max_lora_rank``, with
    ``max_cpu_loras`` (default ``max_loras``) kept loaded.
    ``enforce_eager`` runs every step through the eager modules, never the decode graph
    (``pagedllm.models.decode_graph``). ``kv_cache_dtype`` (vLLM's ``--kv-cache-dtype``) keeps
    the KV cache in the model's dtype (``auto``), in 8-bit floats (``fp8`` = ``fp8_e4m3``,
    ``fp8_e5m2``), written rounded to nearest and saturated, or in int8 with a float16 scale
    per token and KV head (``int8_per_token_head``, the CPU backend's).
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    quantization: str | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    tensor_parallel_size: int = 1
    kernel_backend: str = "auto"
    device: str = "auto"
    speculative_config: SpeculativeConfig | Mapping[str, Any] | str | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    enforce_eager: bool = False
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        self.speculative_config = parse_speculative_config(self.speculative_config)
        _one_of("dtype", self.dtype, DTYPE_CHOICES)
        _one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(
                f"quantization must be one of {QUANTIZATION_CHOICES}, got {self.quantization!r}"
            )
        _positive("block_size", self.block_size)
        if self.block_size > 256:
            raise ValueError(f"block_size must be at most 256, got {self.block_size}")
        if self.kv_cache_memory is not None:
            _positive("kv_cache_memory", self.kv_cache_memory)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _one_of("kernel_backend", self.kernel_backend, BACKENDS)
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        _positive("max_loras", self.max_loras)
        _positive("max_lora_rank", self.max_lora_rank)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        _positive("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                f"({self.max_loras}): the adapters of one step are all held"
            )
        if self.enable_lora and self.tensor_parallel_size != 1:
            raise ValueError("LoRA adapters run on one rank; tensor_parallel_size must be 1")


def resolve_model_dir(model: str | None) -> str:
    """The model to serve: ``model`` (a path, or the file of a packaged model named so, when
    no such path exists), or the demo model's directory (written on first use)."""
    if model is not None:
        from pagedllm.models.named import named_model_path

        named = named_model_path(model)
        return str(named) if named is not None else model
    # Writing the demo model takes torch; only then is it imported.
    from pagedllm.models.demo import demo_model_dir

    return str(demo_model_dir())


def scheduler_config(config: EngineConfig, num_blocks: int, max_model_len: int) -> SchedulerConfig:
    """The scheduler's settings, once the workers know how many KV blocks fit."""
    return SchedulerConfig(
        num_blocks=num_blocks,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=config.enable_prefix_caching,
        seed=config.seed,
        speculative=parse_speculative_config(config.speculative_config),
        max_loras=config.max_loras if config.enable_lora else 0,
        max_cpu_loras=(config.max_cpu_loras or config.max_loras) if config.enable_lora else 0,
    )


def _one_of(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
