"""The distribution maps the repository's folders into one `pagedllm` package."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from pagedllm_testing.layout import REPO as ROOT
from pagedllm_testing.layout import module_of, source_files


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
    assert Path(ours_file) == ROOT / "operator" / "src" / "__init__.py"
    assert item == "6"
    assert torch_loaded == "False"  # the operator stays light


def test_every_source_file_imports_under_the_path_the_rule_gives_it():
    modules = {module_of(p): p for p in source_files()}
    out = run_in_root(
        "import importlib, sys\n"
        f"for name in {sorted(modules)!r}:\n"
        "    print(name, importlib.util.find_spec(name).origin)\n"
    )
    found = dict(line.split(" ", 1) for line in out.splitlines())
    assert {name: Path(origin) for name, origin in found.items()} == modules
    assert module_of(ROOT / "node" / "core" / "scheduler.py") == "pagedllm.core.scheduler"
    assert module_of(ROOT / "kernels" / "src" / "cpu_ops.py") == "pagedllm.kernels.cpu_ops"


def test_the_public_surface_stays_at_the_top():
    out = run_in_root("from pagedllm import LLM, SamplingParams; print(LLM.__module__)")
    assert out == "pagedllm.llm"


def test_the_wheel_carries_every_module_the_data_files_and_the_kernel_source(tmp_path: Path):
    """What a non-editable install (the container image) gets: every module, templates, word
    lists and the C++ source the CPU kernels are built from."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("pagedllm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "pagedllm/kernels/csrc/paged_attention_cpu.cpp" in names
    assert any(n.startswith("pagedllm/models/data/") and n.endswith(".jinja") for n in names)
    page = {"index.html", "login.html", "kv.js", "kv.css"}  # GET /kv
    assert {f"pagedllm/api/kv_page_assets/{name}" for name in page} <= names
    expected = {
        module_of(p).replace(".", "/") + ("/__init__.py" if p.name == "__init__.py" else ".py")
        for p in source_files()
    }
    assert expected <= names, sorted(expected - names)
