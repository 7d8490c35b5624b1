"""Where the Triton kernels run: compiled for the GPU, or through Triton's interpreter.

Triton decides between compiling and interpreting when ``@triton.jit`` wraps a function, its
own library (``tl.sum``, ``tl.cdiv``, ...) included, so without a GPU ``TRITON_INTERPRET=1``
has to be in the environment before triton is first imported. Kernel modules therefore take
``triton`` and ``tl`` from here; that is what lets the ``"triton"`` backend (and its tests)
run on CPU tensors. ``TRITON_INTERPRET=0`` set explicitly keeps the compiler without a GPU:
the kernels can then be compiled ahead of time for a GPU target, not launched
(``bench/kernels_aot.py``).
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "0":
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run "
            "without a GPU; set TRITON_INTERPRET=1 in the environment"
        )
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

__all__ = ["compute_capability", "is_interpreting", "multiprocessor_count", "tl", "triton"]


def is_interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of a GPU; 1 where the kernels are interpreted."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def compute_capability(device: torch.device) -> tuple[int, int] | None:
    """A GPU's (major, minor) compute capability; None where the kernels are interpreted."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)
