"""Building and loading the C++ CPU kernels (``csrc/``: the paged decode attention, the
layers' elementwise work, the weight-only quantized matmul, the float32 panel matmul and the
decode graph that runs a decode step's layers over them, one library).

The sources are compiled once per machine kind with the system C++ compiler, through torch's
extension builder, for the instruction-set level of ``isa.chosen()`` (``$PAGEDLLM_KERNEL_ISA``,
else the best level this CPU executes), into ``$PAGEDLLM_KERNEL_DIR`` (by default ``kernels/``
under the cache directory, ``$PAGEDLLM_CACHE_DIR`` or ``~/.cache/pagedllm``). The build
directory is named after a hash of the sources, the compiler flags (so the levels' builds sit
side by side), the torch version and Python's, and a finished build is loaded straight from
it, so a read-only directory prepared ahead (a container image) works.
Without a compiler the kernels are simply unavailable and the callers fall back to torch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from functools import cache
from pathlib import Path

import torch

from pagedllm.cache import cache_root
from pagedllm.kernels import isa

log = logging.getLogger(__name__)

NAME = "pagedllm_cpu"
CSRC = Path(__file__).with_name("csrc")
SOURCES = (
    "paged_attention_cpu.cpp",
    "layer_ops_cpu.cpp",
    "quant_linear_cpu.cpp",
    "panel_linear_cpu.cpp",
    "decode_graph_cpu.cpp",
)
HEADERS = ("aten.h", "vec.h")
KERNEL_DIR_ENV = "PAGEDLLM_KERNEL_DIR"
DISABLE_ENV = "PAGEDLLM_CPU_KERNELS"  # "0" turns them off
OPS = (
    "paged_decode_attention",
    "rms_norm",
    "add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "write_kv",
    "quant_linear",
    "pack_linear_weight",
    "panel_linear",
    "decode_layers",
)


# Where callers have read the CPU's flags from since before the levels had a module.
cpu_flags = isa.cpu_flags


def has_avx512() -> bool:
    """Whether the kernels are built for AVX-512 (what the panel matmul needs)."""
    return isa.chosen().avx512


def compiler_flags(level: isa.Level | None = None) -> list[str]:
    """-O3, OpenMP and the flags of ``level``, by default the chosen one (``isa.chosen``)."""
    return ["-O3", "-fopenmp", "-fopenmp-simd", *(level or isa.chosen()).flags]


def build_dir(level: isa.Level | None = None) -> Path:
    """Where ``level`` (by default the chosen one) is built: levels live side by side."""
    root = os.environ.get(KERNEL_DIR_ENV) or cache_root() / "kernels"
    digest = hashlib.sha256()
    for part in (
        *((CSRC / name).read_bytes() for name in (*SOURCES, *HEADERS)),
        " ".join(compiler_flags(level)).encode(),
        torch.__version__.encode(),
        sys.version.encode(),
    ):
        digest.update(part)
    return Path(root) / f"{NAME}-{digest.hexdigest()[:16]}"


def _build(target: Path, level: isa.Level) -> None:
    from torch.utils import cpp_extension

    target.mkdir(parents=True, exist_ok=True)
    log.info(
        "compiling the C++ CPU kernels for %s into %s (once per machine kind)", level.name, target
    )
    cpp_extension.load(
        name=NAME,
        sources=[str(CSRC / name) for name in SOURCES],
        extra_cflags=compiler_flags(level),
        build_directory=str(target),
        is_python_module=False,
        verbose=False,
    )


@cache
def load() -> bool:
    """Whether ``torch.ops.pagedllm_cpu`` is available, building it on first use. A level
    ``$PAGEDLLM_KERNEL_ISA`` names that is unknown or that this CPU cannot execute is refused
    (``ValueError``, ``isa.UnexecutableLevel``) rather than left to fall back unnoticed."""
    if os.environ.get(DISABLE_ENV) == "0":
        return False
    level = isa.chosen()
    isa.check_executable(level)
    try:
        target = build_dir(level)
        library = target / f"{NAME}.so"
        if library.exists():
            torch.ops.load_library(str(library))
        else:
            _build(target, level)
        return all(hasattr(torch.ops.pagedllm_cpu, op) for op in OPS)
    except Exception as exc:  # no compiler, no ninja, a read-only cache...
        log.warning("C++ CPU kernels unavailable (%s); using torch's", exc)
        return False


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(0 if load() else 1)
