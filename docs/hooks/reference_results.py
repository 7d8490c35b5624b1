"""The benchmark results: the table `python bench/summary.py` prints from bench/results/*.json,
and the plots beside them, which the benchmark pages show as benchmarks/plots/NAME.png."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
PLOTS = "benchmarks/plots"


def summary_table() -> str:
    """bench/summary.py's output. Run as the script it is (it imports bench/common.py as a
    sibling), by this interpreter, from bench/ so that no folder of the repository shadows a
    package."""
    return subprocess.run(
        [sys.executable, str(BENCH / "summary.py")],
        cwd=BENCH,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout


def plots() -> dict[str, Path]:
    """Path under docs/ -> the plot in bench/results/."""
    return {f"{PLOTS}/{png.name}": png for png in sorted((BENCH / "results").glob("*.png"))}


def page() -> str:
    return (
        "# Results\n\n"
        "The target of every benchmark result under `bench/results/`, as `python "
        "bench/summary.py` prints it when the site is built: one group of rows per result "
        "file, named by the file, with the machine's time, processor and load average at the "
        "start of the run (the results of one machine and one day compare; see each "
        "benchmark's page for its runs, and [Benchmarks](../benchmarks/index.md) for how to "
        "run them).\n\n" + summary_table()
    )


def pages() -> dict[str, str]:
    return {"reference/results.md": page()}
