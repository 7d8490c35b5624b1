"""Building and loading the C++ CPU kernels (``csrc/``: the paged decode attention, the
layers' elementwise work, the weight-only quantized matmul, the float32 panel matmul and the
decode graph that runs a decode step's layers over them, one library).

The sources are compiled once per machine kind with the system C++ compiler, through torch's
extension builder, into ``$PAGEDLLM_KERNEL_DIR`` (by default ``kernels/`` under the cache
directory, ``$PAGEDLLM_CACHE_DIR`` or ``~/.cache/pagedllm``). The build directory is named
after a hash of the sources, the compiler flags and the torch version, and a finished build is
loaded straight from it, so a read-only directory prepared ahead (a container image) works.
Without a compiler the kernels are simply unavailable and the callers fall back to torch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
from functools import cache
from pathlib import Path

import torch

from pagedllm.cache import cache_root

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


@cache
def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


AVX512 = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


def has_avx512() -> bool:
    """Whether the kernels are built for AVX-512 (what the panel matmul needs)."""
    return platform.machine() in ("x86_64", "AMD64") and AVX512 <= cpu_flags()


def compiler_flags() -> list[str]:
    """-O3 and the x86-64 level the CPU has: v4 (AVX-512) or v3 (AVX2 and FMA), both portable
    across a generation of servers, unlike -march=native; with AVX-512 VNNI, the quantized
    matmul's integer products; with AVX-512 BF16, its bfloat16 GEMM at prompt row counts and
    the panels' vdpbf16ps products; with AMX too, the panels' tiles at prompt row counts."""
    flags = ["-O3", "-fopenmp", "-fopenmp-simd"]
    cpu = cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64"):
        return flags
    if has_avx512():
        flags.append("-march=x86-64-v4")
        if "avx512_vnni" in cpu:
            flags.append("-mavx512vnni")
        if "avx512_bf16" in cpu:
            flags.append("-mavx512bf16")
            if {"amx_tile", "amx_bf16"} <= cpu:
                flags += ["-mamx-tile", "-mamx-bf16"]
    elif {"avx2", "fma", "bmi2", "f16c"} <= cpu:
        flags.append("-march=x86-64-v3")
    return flags


def build_dir() -> Path:
    root = os.environ.get(KERNEL_DIR_ENV) or cache_root() / "kernels"
    digest = hashlib.sha256()
    for part in (
        *((CSRC / name).read_bytes() for name in (*SOURCES, *HEADERS)),
        " ".join(compiler_flags()).encode(),
        torch.__version__.encode(),
        sys.version.encode(),
    ):
        digest.update(part)
    return Path(root) / f"{NAME}-{digest.hexdigest()[:16]}"


def _build(target: Path) -> None:
    from torch.utils import cpp_extension

    target.mkdir(parents=True, exist_ok=True)
    log.info("compiling the CPU attention kernels into %s (once per machine kind)", target)
    cpp_extension.load(
        name=NAME,
        sources=[str(CSRC / name) for name in SOURCES],
        extra_cflags=compiler_flags(),
        build_directory=str(target),
        is_python_module=False,
        verbose=False,
    )


@cache
def load() -> bool:
    """Whether ``torch.ops.pagedllm_cpu`` is available, building it on first use."""
    if os.environ.get(DISABLE_ENV) == "0":
        return False
    try:
        target = build_dir()
        library = target / f"{NAME}.so"
        if library.exists():
            torch.ops.load_library(str(library))
        else:
            _build(target)
        return all(hasattr(torch.ops.pagedllm_cpu, op) for op in OPS)
    except Exception as exc:  # no compiler, no ninja, a read-only cache...
        log.warning("CPU attention kernels unavailable (%s); using torch's", exc)
        return False


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(0 if load() else 1)
