"""The newest release of every dependency, for `make test-latest` (requirements/latest.sh).

    python requirements/latest.py install   # into this interpreter's venv
    python requirements/latest.py report    # which installed releases pyproject's bounds exclude

Every requirement of pyproject (its dependencies and the test, bench and docs extras) is installed
with its lower bound only, transitive dependencies upgraded too, except the bounds in KEPT: those
are known breakages or choices, not releases waiting to be tested.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parent.parent
EXTRAS = ("test", "bench", "docs")
KEPT = {
    # The CPU build from PyTorch's index (requirements/bootstrap.txt): a newer torch is a
    # deliberate move (its CPU wheel, the C++ kernels built against it, the CUDA image's Triton).
    "torch": "the locked CPU build",
    # The Triton that torch 2.13's CUDA wheels pin: the ahead-of-time kernel check compiles with it.
    "triton": "pinned to torch's",
    # The Triton interpreter (kernels on the CPU) breaks with numpy 2.4 (triton-lang/triton#9171).
    "numpy": "Triton's interpreter breaks with numpy 2.4",
}
# The packages installed without their dependencies (SmolLM2's file).
MODELS = ROOT / "requirements" / "models.in"


def requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = list(project["dependencies"])
    for extra in EXTRAS:
        listed += project["optional-dependencies"][extra]
    return [Requirement(r) for r in listed]


def unbounded(req: Requirement) -> str:
    if req.name.lower() == "torch":  # the build installed from the bootstrap lock, exactly
        return f"torch=={version('torch')}"
    if req.name.lower() in KEPT:
        return str(req)
    lower = SpecifierSet(",".join(str(s) for s in req.specifier if s.operator in (">=", ">")))
    marker = f"; {req.marker}" if req.marker else ""
    return f"{req.name}{lower}{marker}"


def install() -> None:
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    newest = [unbounded(r) for r in requirements()]
    model = [line for line in MODELS.read_text().splitlines() if line and line[0] != "#"]
    editable = ["-e", str(ROOT), "-e", str(ROOT / "testing")]
    # Run from elsewhere: -m puts the working directory first on sys.path, where the root's
    # operator/ would shadow the standard library's.
    with tempfile.TemporaryDirectory() as elsewhere:
        for args in (
            ["--upgrade", "--upgrade-strategy", "eager", *newest],
            ["--no-deps", *model],
            ["--no-deps", "--no-build-isolation", *editable],
        ):
            subprocess.run([*pip, *args], check=True, cwd=elsewhere)


def report() -> None:
    excluded = []
    for req in requirements():
        try:
            installed = version(req.name)
        except PackageNotFoundError:
            continue
        if not req.specifier.contains(installed, prereleases=True):
            excluded.append(f"  {req.name} {installed} (pyproject: {req.specifier})")
    kept = [f"  {name}: {why}" for name, why in KEPT.items()]
    print("make test-latest: upper bounds kept:", *kept, sep="\n")
    if excluded:
        print(
            "make test-latest: newest releases that pyproject's bounds exclude:",
            *excluded,
            sep="\n",
        )
    else:
        print("make test-latest: pyproject's bounds exclude no newest release")


if __name__ == "__main__":
    {"install": install, "report": report}[sys.argv[1]]()
