"""llama.cpp's ``llama-server`` as a peer of the benchmarks: built for this CPU from the sdist of
``llama-cpp-python`` (which vendors the whole llama.cpp tree, server and converter included),
and a bfloat16 GGUF file written from a Hugging Face directory by llama.cpp's own converter, so
that both engines serve the same weights.

    python bench/quantized.py --setup-llama     # builds it once under --llama-dir
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_DIR = Path(tempfile.gettempdir()) / "pagedllm-llama.cpp"
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"  # its sdist vendors llama.cpp, server included


def server_path(directory: Path) -> Path:
    return directory / "build" / "bin" / "llama-server"


def source_dir(directory: Path) -> Path:
    (source,) = directory.glob("llama_cpp_python-*/vendor/llama.cpp")
    return source


def setup(directory: Path) -> Path:
    """Download the sdist and build ``llama-server`` for this CPU; its path."""
    binary = server_path(directory)
    if binary.exists():
        return binary
    directory.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    subprocess.run([*pip, "-d", str(directory), LLAMA_CPP_PYTHON], check=True)
    (archive,) = directory.glob("llama_cpp_python-*.tar.gz")
    subprocess.run(["tar", "xzf", archive.name], cwd=directory, check=True)
    build = directory / "build"
    # Without AMX: on a CPU that has it (Sapphire/Granite Rapids), ggml's AMX matmul in this
    # release dies of SIGILL at its first product (tilezero with no tile configuration loaded),
    # so llama-server cannot start; its AVX-512 VNNI kernels and weight repacking stay.
    no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    subprocess.run(
        [
            "cmake", "-S", str(source_dir(directory)), "-B", str(build), "-DGGML_NATIVE=ON",
            "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}",
        ],
        check=True,
    )  # fmt: skip
    jobs = str(os.cpu_count() or 2)
    subprocess.run(
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], check=True
    )
    return binary


def bf16_gguf(hf_dir: Path, directory: Path, python: Path) -> Path:
    """A bfloat16 GGUF file of the Hugging Face directory ``hf_dir``, written once beside the
    build by the converter of the same llama.cpp tree (its own ``gguf-py`` first on its path),
    run by ``python``: one with transformers, torch and sentencepiece, as the vLLM peers' venv
    has (the project's own lacks sentencepiece, which the converter imports)."""
    target = directory / f"{hf_dir.name}-bf16.gguf"
    if target.exists():
        return target
    partial = target.with_suffix(".partial")
    subprocess.run(
        [
            str(python),
            str(source_dir(directory) / "convert_hf_to_gguf.py"),
            str(hf_dir),
            "--outtype",
            "bf16",
            "--outfile",
            str(partial),
        ],
        cwd=directory,  # not the repository: its operator/ folder would shadow the stdlib's
        check=True,
    )
    partial.rename(target)
    return target
