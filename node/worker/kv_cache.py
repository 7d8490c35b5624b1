"""Sizing and allocating the paged KV cache."""

from __future__ import annotations

import os

import torch

from pagedllm.kernels import reference

# The 8-bit cache elements by their vLLM names ("auto" is the model's dtype); int8 rows carry
# their scales (kernels/src/reference.py).
EIGHT_BIT_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8_per_token_head": reference.INT8_ROWS,
}


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element the cache holds for ``--kv-cache-dtype`` (validated by EngineConfig)."""
    return EIGHT_BIT_DTYPES.get(kv_cache_dtype, model_dtype)


# Share of the available memory the CPU cache takes by default, and its ceiling.
CPU_KV_FRACTION = 0.1
CPU_KV_CEILING = 4 << 30


def block_bytes(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes across all layers, K and V."""
    element = torch.empty((), dtype=dtype).element_size()
    row = reference.cache_row_size(head_dim, dtype)
    return 2 * num_layers * block_size * num_kv_heads * row * element


def available_cpu_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def default_cpu_kv_memory() -> int:
    return int(min(available_cpu_memory() * CPU_KV_FRACTION, CPU_KV_CEILING))


def check_fits(num_blocks: int, block_size: int, max_model_len: int, memory: int) -> None:
    """Fail at start when not even one max_model_len sequence fits in the cache."""
    capacity = num_blocks * block_size
    if capacity < max_model_len:
        raise ValueError(
            f"the KV cache ({memory} bytes, {num_blocks} blocks of {block_size} tokens) holds "
            f"{capacity} tokens, fewer than max_model_len={max_model_len}; give it more memory "
            f"(kv_cache_memory / gpu_memory_utilization) or set max_model_len to at most "
            f"{capacity}"
        )


def allocate(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, block_size, num_kv_heads, reference.cache_row_size(head_dim, dtype))
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(num_layers)
    ]
