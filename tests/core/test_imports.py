"""The engine core is plain Python: it loads neither torch nor ZeroMQ."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "node" / "core"
CORE_MODULES = sorted(f"pagedllm.core.{p.stem}" for p in CORE.glob("*.py") if p.stem != "__init__")


def test_the_core_has_modules_to_check() -> None:
    assert "pagedllm.core.scheduler" in CORE_MODULES


@pytest.mark.parametrize("module", CORE_MODULES)
def test_core_module_loads_neither_torch_nor_zmq(module: str) -> None:
    # A fresh interpreter: in this one some other test has long since imported torch.
    code = (
        f"import importlib, sys\nimportlib.import_module({module!r})\n"
        "print(sorted(m for m in ('torch', 'zmq') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"{module} loads {done.stdout.strip()}"
