"""Building and loading the C++ CPU kernels, in fresh processes (``load`` is once per process)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from pagedllm.kernels import cpu_extension

PROBE = """
import logging, sys, torch
logging.basicConfig(level=logging.INFO)
from pagedllm.kernels import cpu_extension, cpu_ops
loaded = cpu_extension.load()
q = torch.randn(2, 4, 64)
cache = torch.randn(3, 16, 2, 64)
tables = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
out = cpu_ops.paged_attention(q, cache, cache, tables, torch.tensor([0, 1, 2]),
                              torch.tensor([20, 9]), 0.125, max_seqlen_q=1)
assert out.shape == q.shape and bool(torch.isfinite(out).all())
print("loaded" if loaded else "fallback")
"""


def probe(kernel_dir: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, cpu_extension.KERNEL_DIR_ENV: str(kernel_dir), **env},
    )


def snapshot(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.stat().st_mtime for p in root.rglob("*")}


def test_a_prepared_build_is_loaded_without_writing(tmp_path: Path):
    assert cpu_extension.load()
    built = cpu_extension.build_dir()
    shutil.copytree(built, tmp_path / built.name)
    before = snapshot(tmp_path)
    result = probe(tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["loaded"]
    assert snapshot(tmp_path) == before
    assert "compiling" not in result.stderr


def test_without_a_compiler_the_torch_fallback_serves(tmp_path: Path):
    result = probe(tmp_path / "kernels", CXX="/bin/false")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["fallback"]
    assert "CPU attention kernels unavailable" in result.stderr


def test_the_kernels_can_be_turned_off(tmp_path: Path):
    result = probe(tmp_path, **{cpu_extension.DISABLE_ENV: "0"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["fallback"]
    assert not any(tmp_path.iterdir())


# Each instruction-set path is compiled on every x86 machine, whatever its CPU: the library a
# machine builds holds only the paths of its own CPU. The instruction each path is for must be
# in the object.
ISA_PATHS = {
    "avx512_bf16": (
        ["-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"],
        {"panel_linear_cpu.cpp": "vdpbf16ps", "quant_linear_cpu.cpp": "vcvtne2ps2bf16"},
    ),
    "amx_bf16": (
        ["-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"],
        {"panel_linear_cpu.cpp": "tdpbf16ps"},
    ),
}


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or shutil.which("g++") is None,
    reason="the x86 paths are compiled with g++ on x86 machines",
)
@pytest.mark.parametrize("isa", sorted(ISA_PATHS))
def test_every_instruction_set_path_compiles_on_every_x86_machine(isa: str, tmp_path: Path):
    from torch.utils import cpp_extension

    flags, instructions = ISA_PATHS[isa]
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    includes.append(f"-I{sysconfig.get_paths()['include']}")
    for source, instruction in instructions.items():
        assert source in cpu_extension.SOURCES
        obj = tmp_path / f"{source}.o"
        build = subprocess.run(
            ["g++", "-std=c++20", "-fPIC", "-O2", "-fopenmp", *flags, *includes]
            + ["-DTORCH_EXTENSION_NAME=pagedllm_cpu", "-DTORCH_API_INCLUDE_EXTENSION_H"]
            + ["-c", str(cpu_extension.CSRC / source), "-o", str(obj)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert build.returncode == 0, build.stderr[-4000:]
        listing = subprocess.run(
            ["objdump", "-d", str(obj)], capture_output=True, text=True, check=True
        ).stdout
        assert f"\t{instruction} " in listing or f" {instruction} " in listing, source
