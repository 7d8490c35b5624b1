"""Import ``pagedllm`` from this checkout, installed or not.

The distribution maps folders onto packages (``kernels/`` is ``pagedllm.kernels``, ``node/`` is
``pagedllm.node``), which no ``PYTHONPATH`` entry can express. Loading the root package with
the repository root on its ``__path__`` does: every top-level folder becomes a subpackage.

``python bench/_bootstrap.py MODULE ARGS...`` runs a module the way ``python -m`` does, with
``pagedllm`` imported from here (e.g. ``python bench/_bootstrap.py pytest tests/...``).
"""

from __future__ import annotations

import importlib.util
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOT_PACKAGE = REPO / "node" / "package_root"


def use_checkout() -> None:
    if "pagedllm" in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(
        "pagedllm",
        ROOT_PACKAGE / "__init__.py",
        submodule_search_locations=[str(ROOT_PACKAGE), str(REPO)],
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules["pagedllm"] = package
    spec.loader.exec_module(package)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python bench/_bootstrap.py MODULE [ARGS...]")
    use_checkout()
    module = sys.argv[1]
    sys.argv = sys.argv[1:]
    # As under ``python -m``: the working directory first, not this script's folder.
    sys.path[0] = str(Path.cwd())
    runpy.run_module(module, run_name="__main__", alter_sys=True)
