"""No folder of the repository shadows an installed distribution or the standard library.

pytest runs with ``--import-mode=importlib`` and imports the project as installed: ``pagedllm``
(node/, kernels/, operator/) and the test support ``pagedllm_testing`` (testing/). Were the
repository root on ``sys.path``, ``import kernels`` would find our kernels/ instead of Hugging
Face's ``kernels`` (which transformers imports), and ``operator`` would shadow the standard
library's. The benchmarks run as ``python bench/NAME.py``, which puts bench/ first on the path,
so no script there may carry the name of an installed module either.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRACKED = subprocess.run(
    ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
).stdout.split()
# The repository's own folders that are no test package: none may be importable by its name.
FOLDERS = sorted({f.split("/")[0] for f in TRACKED if "/" in f} - {"tests", "e2e", ".ci"})


def inside_repository(path: str | None) -> bool:
    """In one of the repository's own folders (a virtual environment in .venv/ is not)."""
    if path is None or not Path(path).resolve().is_relative_to(REPO):
        return False
    return Path(path).resolve().relative_to(REPO).parts[0] in FOLDERS


def test_the_folders_checked_include_those_that_clash() -> None:
    assert {"kernels", "node", "operator", "bench", "crds", "docs", "manifests"} <= set(FOLDERS)


def test_the_repository_root_is_not_on_the_path() -> None:
    assert all(Path(entry or ".").resolve() != REPO for entry in sys.path), sys.path


@pytest.mark.parametrize("name", FOLDERS)
def test_no_folder_resolves_inside_the_repository(name: str) -> None:
    spec = importlib.util.find_spec(name)
    if spec is None:
        return
    places = [spec.origin, *(spec.submodule_search_locations or [])]
    assert not any(inside_repository(p) for p in places), f"{name} resolves to {places}"


def test_kernels_is_hugging_faces_distribution() -> None:
    """transformers imports it when it loads a model class."""
    spec = importlib.util.find_spec("kernels")
    assert spec is not None and spec.origin is not None
    assert importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py") == (
        Path(spec.origin)
    )
    from transformers.integrations import hub_kernels  # the import that failed when shadowed

    assert hub_kernels is not None


def test_operator_is_the_standard_librarys() -> None:
    import operator

    assert operator.itemgetter(1)([5, 6]) == 6 and not inside_repository(operator.__file__)


def test_the_project_is_imported_as_installed() -> None:
    import pagedllm
    import pagedllm.kernels
    import pagedllm.operator
    import pagedllm_testing

    assert Path(pagedllm.__file__).parent == REPO / "node"
    assert Path(pagedllm.kernels.__file__).parent == REPO / "kernels" / "src"
    assert Path(pagedllm.operator.__file__).parent == REPO / "operator" / "src"
    assert Path(pagedllm_testing.__file__).parent == REPO / "testing" / "pagedllm_testing"


def test_no_benchmark_script_is_named_as_an_installed_module() -> None:
    installed = set(importlib.metadata.packages_distributions()) | set(sys.stdlib_module_names)
    scripts = {p.stem for p in (REPO / "bench").glob("*.py")}
    assert not scripts & installed, sorted(scripts & installed)
