"""The one rule from a source file of the repository to its import path: pyproject's
package-dir, as docs/contributing.md states it."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# kernels/ and operator/ keep their sources in src/, so that neither folder is a package.
PACKAGE_OF_FOLDER = {
    "node": "pagedllm",
    "kernels/src": "pagedllm.kernels",
    "operator/src": "pagedllm.operator",
}


def module_of(path: Path) -> str:
    """``node/core/scheduler.py`` -> ``pagedllm.core.scheduler``; a package's ``__init__.py``
    -> the package."""
    relative = path.relative_to(REPO).with_suffix("")
    (folder,) = (f for f in PACKAGE_OF_FOLDER if relative.is_relative_to(f))
    parts = [PACKAGE_OF_FOLDER[folder], *relative.relative_to(folder).parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files() -> list[Path]:
    return sorted(p for folder in PACKAGE_OF_FOLDER for p in (REPO / folder).rglob("*.py"))
