"""Paged-attention kernels: Triton on CUDA, a C++ decode kernel and torch on the CPU.

``kernel_ops(backend)`` returns the backend, a module meeting
:class:`pagedllm.kernels.backend.KernelOps` (paged attention, the KV write and block copy, the
layers' elementwise work and the weight-only quantized matmul). ``backend`` is ``"auto"``
(Triton on CUDA, the CPU backend elsewhere), ``"cpu"`` (a C++ decode kernel, see
``cpu_ops``), ``"torch"`` (the pure-torch reference) or ``"triton"`` (on the CPU the Triton
interpreter is used, see ``triton_device``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    import torch

    from pagedllm.kernels import cpu_ops, reference, triton_ops
    from pagedllm.kernels.backend import KernelOps

    # mypy holds each backend module to the contract.
    _BACKEND_MODULES: tuple[KernelOps, ...] = (cpu_ops, reference, triton_ops)

BACKENDS = ("auto", "cpu", "torch", "triton")
# What every backend module provides: KernelOps' members (a test holds them equal), named
# here so that this package's import needs no torch.
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


def kernel_ops(backend: str, device: torch.device) -> KernelOps:
    name = resolve_backend(backend, device)
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"the cpu kernel backend runs on CPU tensors, not {device.type}")
    # Imported only when chosen: the Triton backend sets up Triton's interpreter.
    return cast("KernelOps", importlib.import_module(f"{__name__}.{MODULES[name]}"))
