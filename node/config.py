"""Engine settings, validated once at the border."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.kernels import BACKENDS

DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass
class EngineConfig:
    """Settings of one serving engine, with vLLM's names and meanings.

    ``model`` is a local Hugging Face directory; None means the built-in demo model.
    ``kv_cache_memory`` (bytes) sizes the KV cache directly; otherwise on CUDA
    ``gpu_memory_utilization`` of the device goes to weights, activations and cache, and on
    the CPU a share of the free memory is used.
    """

    model: str | None = None
    dtype: str = "auto"
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

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
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
        if self.kernel_backend not in BACKENDS:
            raise ValueError(
                f"kernel_backend must be one of {BACKENDS}, got {self.kernel_backend!r}"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
