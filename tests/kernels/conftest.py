"""What tests/kernels/test_kernel_levels.py found of each instruction-set level of the C++ CPU
kernels, said at the end of the run: which levels ran, which this CPU could only compile."""

from __future__ import annotations

import pytest

LEVELS = pytest.StashKey[dict[str, str]]()


@pytest.fixture
def level_report(request: pytest.FixtureRequest) -> dict[str, str]:
    """Level name -> what became of it, for the terminal summary."""
    return request.config.stash.setdefault(LEVELS, {})


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    report = config.stash.get(LEVELS, {})
    if report:
        terminalreporter.write_sep("-", "C++ CPU kernel levels")
        for name, what in report.items():
            terminalreporter.write_line(f"{name}: {what}")
