"""What a new user types first works from the repository root, where Python puts the current
folder first on ``sys.path``: the README's offline example, and pytest run as ``python -m
pytest``. Neither kernels/ nor operator/ is a package there (their sources are in src/), so
``import kernels`` (which transformers does) finds Hugging Face's and ``import operator`` the
standard library's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pagedllm_testing.layout import REPO


def run_from_root(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    # As typed in a shell with the venv active: no safe-path setting keeps the folder off.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_offline_example_generates_from_the_repository_root() -> None:
    done = run_from_root(
        "-c",
        "from pagedllm import LLM, SamplingParams\n"
        "import kernels, operator\n"
        "print(kernels.__file__, operator.__file__)\n"
        "params = SamplingParams(max_tokens=4)\n"
        "(out,) = LLM().generate('Once upon a time', params, use_tqdm=False)\n"
        "print(len(out.outputs[0].token_ids))",
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    found, count = done.stdout.strip().splitlines()[-2:]
    # Hugging Face's distribution and the standard library's module, not our folders.
    for name, path in zip(("kernels", "operator"), found.split(), strict=True):
        assert not Path(path).is_relative_to(REPO / name), path
    assert count == "4"


PYTEST = ("-m", "pytest", "-q", "-p", "no:cacheprovider")


def test_python_m_pytest_collects_and_runs_the_models_tests_from_the_repository_root() -> None:
    collected = run_from_root(*PYTEST, "--collect-only", "tests/models", timeout=300)
    assert collected.returncode == 0, collected.stdout + collected.stderr
    assert "tests/models/test_smollm2.py" in collected.stdout
    ran = run_from_root(*PYTEST, "tests/models/test_quantized.py", timeout=300)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert " passed" in ran.stdout
