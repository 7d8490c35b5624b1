"""The targets of the latest results under ``bench/results/`` as one Markdown table.

python bench/summary.py
"""

from __future__ import annotations

import json

import common

BENCHMARKS = ("throughput", "memory", "serving", "roofline")


def main() -> None:
    print("| benchmark | target | measured | met | when, load at start |")
    print("|---|---|---|---|---|")
    for name in BENCHMARKS:
        # Each benchmark on the random benchmark model, then on SmolLM2 where it was run so
        # (`--model smollm2 --name NAME-smollm2`).
        for result, label in ((name, name), (f"{name}-smollm2", f"{name} (SmolLM2)")):
            path = common.RESULTS / f"{result}.json"
            if path.is_file():
                print_targets(label, json.loads(path.read_text()))
            elif result == name:
                print(f"| {name} | (not run) | | | |")


def print_targets(label: str, data: dict) -> None:
    machine = data.get("machine", {})
    load = machine.get("load_average_1m_at_start", machine.get("load_average_1m", 0))
    when = f"{machine.get('time', '?')[:16]}, {load:.1f}"
    for t in data.get("targets", []):
        op = "≤" if t["at_most"] else "≥"
        value = "n/a" if t["value"] is None else f"{t['value']:.3g}{t['unit']}"
        note = f" ({t['note']})" if t.get("note") else ""
        met = {True: "yes", False: "no", None: "not measured"}[t["met"]]
        print(
            f"| {label} | {t['name']} {op} {t['threshold']:g}{t['unit']} | {value}{note} "
            f"| {met} | {when} |"
        )


if __name__ == "__main__":
    main()
