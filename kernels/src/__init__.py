"""Paged-attention kernels: Triton on CUDA, a C++ decode kernel and torch on the CPU.

``kernel_ops(backend)`` returns the module implementing ``paged_attention``, ``write_kv`` and
``copy_blocks`` with the contract documented in :mod:`pagedllm.kernels.reference`, and the
layers' elementwise work (``rms_norm``, ``add_rms_norm``, ``rotary_embedding``,
``silu_and_mul``) with that of :mod:`pagedllm.kernels.layer_ops`, and the weight-only
quantized matmul (``quant_linear``) with that of :mod:`pagedllm.kernels.quant_linear`.
``backend`` is ``"auto"`` (Triton on CUDA, the CPU backend elsewhere), ``"cpu"`` (a C++
decode kernel, see ``cpu_ops``), ``"torch"`` (the pure-torch reference) or ``"triton"`` (on
the CPU the Triton interpreter is used, see ``triton_device``).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BACKENDS = ("auto", "cpu", "torch", "triton")
# What every backend module provides.
OPS = (
    "paged_attention",
    "write_kv",
    "copy_blocks",
    "rms_norm",
    "add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "quant_linear",
)
MODULES = {"cpu": "cpu_ops", "torch": "reference", "triton": "triton_ops"}


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "cpu"
    return backend


def kernel_ops(backend: str, device: torch.device) -> ModuleType:
    name = resolve_backend(backend, device)
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"the cpu kernel backend runs on CPU tensors, not {device.type}")
    return importlib.import_module(f"{__name__}.{MODULES[name]}")
