"""Building and loading the C++ CPU kernels, in fresh processes (``load`` is once per process)."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from pagedllm.kernels import cpu_extension, isa

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
    assert "C++ CPU kernels unavailable" in result.stderr


def test_the_kernels_can_be_turned_off(tmp_path: Path):
    result = probe(tmp_path, **{cpu_extension.DISABLE_ENV: "0"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["fallback"]
    assert not any(tmp_path.iterdir())


# What each level's code must hold, by source: a pattern of objdump's listing (an instruction,
# and its registers where the width is the point). Every level is built on every x86 machine,
# whatever its CPU: the levels this CPU executes as the kernels are built (the per-level runs of
# test_kernel_levels.py build them too), the others only their sources named here.
ISA_PATHS: dict[str, dict[str, str]] = {
    "amx": {"panel_linear_cpu.cpp": r"tdpbf16ps "},
    "avx512-bf16-vnni": {
        "panel_linear_cpu.cpp": r"vdpbf16ps ",
        "quant_linear_cpu.cpp": r"vcvtne2ps2bf16 ",
    },
    "avx512-vnni": {"quant_linear_cpu.cpp": r"vpdpbusd "},
    "avx512": {
        "paged_attention_cpu.cpp": r"vfmadd\w+ps .*%zmm",
        "quant_linear_cpu.cpp": r"vpmovzxbd .*%zmm",
    },
    "avx2": {
        "paged_attention_cpu.cpp": r"vfmadd\w+ps .*%ymm",
        "quant_linear_cpu.cpp": r"vpmovzxbd .*%ymm",
        "layer_ops_cpu.cpp": r"vcvtph2ps ",  # F16C's half floats
    },
    "generic": {},
}
X86 = platform.machine() in ("x86_64", "AMD64")


def test_the_table_has_an_entry_for_every_level() -> None:
    assert sorted(ISA_PATHS) == sorted(isa.NAMES)


def compile_alone(level: isa.Level, source: str, obj: Path) -> subprocess.Popen:
    """``source`` (an empty one where the level has none to check) compiled for ``level`` with
    the flags the extension gets."""
    from torch.utils import cpp_extension

    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    includes.append(f"-I{sysconfig.get_paths()['include']}")
    source_args = [str(cpu_extension.CSRC / source)] if source else ["-x", "c++", "/dev/null"]
    return subprocess.Popen(
        ["g++", "-std=c++20", "-fPIC", *cpu_extension.compiler_flags(level), *includes]
        + ["-DTORCH_EXTENSION_NAME=pagedllm_cpu", "-DTORCH_API_INCLUDE_EXTENSION_H"]
        + ["-c", *source_args, "-o", str(obj)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def built_objects(level: isa.Level) -> Path:
    """The build of ``level`` (which this CPU executes), made in a process of its own."""
    target = cpu_extension.build_dir(level)
    if not (target / f"{cpu_extension.NAME}.so").exists():
        build = subprocess.run(
            [sys.executable, "-P", "-m", "pagedllm.kernels.cpu_extension"],
            capture_output=True,
            text=True,
            timeout=1800,
            env={**os.environ, isa.ISA_ENV: level.name},
        )
        assert build.returncode == 0, build.stderr[-4000:]
    return target


@pytest.mark.skipif(
    not X86 or shutil.which("g++") is None,
    reason="the x86 levels are compiled with g++ on x86 machines",
)
@pytest.mark.parametrize("name", isa.NAMES)
def test_every_level_compiles_on_every_x86_machine(name: str, tmp_path: Path):
    level = isa.named(name)
    instructions = ISA_PATHS[name]
    if isa.executable(level, isa.cpu_flags()):
        objects = built_objects(level)
    else:
        objects = tmp_path
        builds = [
            compile_alone(level, source, tmp_path / f"{Path(source).stem}.o")
            for source in instructions or [""]
        ]
        for build in builds:  # side by side: each source is its own compiler process
            output = build.communicate(timeout=900)[0]
            assert build.returncode == 0, output[-4000:]
    for source, instruction in instructions.items():
        assert source in cpu_extension.SOURCES
        listing = subprocess.run(
            ["objdump", "-d", str(objects / f"{Path(source).stem}.o")],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert re.search(f"\t{instruction}", listing), (name, source, instruction)
