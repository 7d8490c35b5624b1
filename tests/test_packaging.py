"""The distribution maps the repository's folders into one `pagedllm` package."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_in_root(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_operator_package_and_stdlib_operator_coexist_from_the_repository_root():
    out = run_in_root(
        "import operator as std, pagedllm.operator as ours, sys\n"
        "print(std.__file__); print(ours.__file__); print(std.itemgetter(1)([5, 6]))\n"
        "print('torch' in sys.modules)"
    )
    std_file, ours_file, item, torch_loaded = out.splitlines()
    assert Path(std_file).parent != ROOT / "operator" and Path(std_file).name == "operator.py"
    assert Path(ours_file) == ROOT / "operator" / "__init__.py"
    assert item == "6"
    assert torch_loaded == "False"  # the operator stays light


def test_package_folders_map_to_subpackages():
    out = run_in_root(
        "import pagedllm, pagedllm.node, pagedllm.kernels\n"
        "print(pagedllm.node.__file__); print(pagedllm.kernels.__file__)\n"
        "from pagedllm import LLM, SamplingParams; print(LLM.__module__)"
    )
    node_file, kernels_file, llm_module = out.splitlines()
    assert Path(node_file) == ROOT / "node" / "__init__.py"
    assert Path(kernels_file) == ROOT / "kernels" / "__init__.py"
    assert llm_module == "pagedllm.node.llm"


def test_the_wheel_carries_the_data_files_and_the_kernel_source(tmp_path: Path):
    """What a non-editable install (the container image) gets: templates, word lists and the
    C++ source the CPU kernels are built from."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("pagedllm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "pagedllm/kernels/csrc/paged_attention_cpu.cpp" in names
    assert any(n.startswith("pagedllm/node/data/") and n.endswith(".jinja") for n in names)
