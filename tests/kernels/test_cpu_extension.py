"""Building and loading the C++ CPU kernels, in fresh processes (``load`` is once per process)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

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
