"""Paged-attention kernels: Triton on CUDA, pure torch on the CPU.

``kernel_ops(backend)`` returns the module implementing ``paged_attention``, ``write_kv`` and
``copy_blocks`` with the contract documented in :mod:`pagedllm.kernels.reference`.
``backend`` is ``"auto"`` (Triton on CUDA, torch elsewhere), ``"torch"`` or ``"triton"``
(on the CPU the Triton interpreter is used, see ``triton_device``).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

BACKENDS = ("auto", "torch", "triton")


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


def kernel_ops(backend: str, device: torch.device) -> ModuleType:
    name = resolve_backend(backend, device)
    module = "reference" if name == "torch" else "triton_ops"
    return importlib.import_module(f"{__name__}.{module}")
