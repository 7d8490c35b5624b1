"""The metrics reference, read from the metrics' definitions in the code: every call of a
prometheus-client metric class (or of a module helper that wraps one) with a literal name in
the node's and the router's metrics modules, with its type, labels and help text. The modules
are parsed, not imported, so the reference needs neither torch nor a running node; a test holds
it to what a live node (speculating) and router export."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reference_tables import anchored, cell, table

REPO = Path(__file__).resolve().parents[2]
# The process that exports a module's metrics, and the module.
SOURCES = {
    "node": REPO / "node" / "runtime" / "metrics.py",
    "router": REPO / "node" / "router" / "metrics.py",
}
TYPES = {
    "Counter": "counter",
    "Gauge": "gauge",
    "Histogram": "histogram",
    "Summary": "summary",
    "CounterMetricFamily": "counter",
    "GaugeMetricFamily": "gauge",
    "HistogramMetricFamily": "histogram",
    "SummaryMetricFamily": "summary",
}
# The series a family of each type exposes, by suffix.
SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
}


@dataclass(frozen=True)
class Metric:
    name: str  # the family's name: vllm:prompt_tokens (exposed as vllm:prompt_tokens_total)
    type: str
    labels: tuple[str, ...]
    help: str
    process: str

    @property
    def series(self) -> tuple[str, ...]:
        return tuple(self.name + suffix for suffix in SUFFIXES[self.type])


def _constants(tree: ast.Module) -> dict[str, Any]:
    """The module's literal constants (LABEL = "model_name", ...)."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                try:
                    found[target.id] = ast.literal_eval(node.value)
                except ValueError:
                    pass
    return found


def _literal(node: ast.expr | None, constants: dict[str, Any]) -> Any:
    """A literal, its names taken from the module's constants (None: not a literal)."""
    if node is None:
        return None

    class Substitute(ast.NodeTransformer):
        def visit_Name(self, name: ast.Name) -> ast.AST:
            if name.id in constants:
                return ast.Constant(constants[name.id])
            return name

    try:
        return ast.literal_eval(Substitute().visit(ast.fix_missing_locations(node)))
    except ValueError:
        return None


def _constructor(call: ast.Call) -> tuple[str, ast.Call] | None:
    """(class name, its call) of ``Gauge(...)`` or ``Gauge(...).labels(...)``."""
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Call):
        return _constructor(func.value)
    if isinstance(func, ast.Name) and func.id in TYPES:
        return func.id, call
    return None


def _labels(call: ast.Call, constants: dict[str, Any]) -> tuple[str, ...] | None:
    given = call.args[2] if len(call.args) > 2 else None
    for keyword in call.keywords:
        if keyword.arg in ("labelnames", "labels"):
            given = keyword.value
    if given is None:
        return ()
    value = _literal(given, constants)
    return None if value is None else tuple(value)


def _helpers(tree: ast.Module, constants: dict[str, Any]) -> dict[str, tuple[str, tuple]]:
    """Module functions that return a metric named by their first parameter:
    name -> (class, labels)."""
    found = {}
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or not node.args.args:
            continue
        last = node.body[-1]
        if not (isinstance(last, ast.Return) and isinstance(last.value, ast.Call)):
            continue
        made = _constructor(last.value)
        if made is None:
            continue
        cls, call = made
        first = call.args[0] if call.args else None
        if isinstance(first, ast.Name) and first.id == node.args.args[0].arg:
            labels = _labels(call, constants)
            if labels is not None:
                found[node.name] = (cls, labels)
    return found


def metrics_of(process: str, path: Path) -> list[Metric]:
    tree = ast.parse(path.read_text())
    constants = _constants(tree)
    helpers = _helpers(tree, constants)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            continue
        args = node.args
        if not args or not isinstance(args[0], ast.Constant) or not isinstance(args[0].value, str):
            continue
        if node.func.id in TYPES:
            cls, labels = node.func.id, _labels(node, constants)
        elif node.func.id in helpers:
            cls, labels = helpers[node.func.id]
        else:
            continue
        doc = _literal(args[1], constants) if len(args) > 1 else None
        for keyword in node.keywords:
            if keyword.arg in ("documentation", "doc"):
                doc = _literal(keyword.value, constants)
        found.append(Metric(args[0].value, TYPES[cls], labels or (), doc or "", process))
    return sorted(found, key=lambda m: m.name)


def all_metrics() -> list[Metric]:
    return [m for process, path in SOURCES.items() for m in metrics_of(process, path)]


def series_names() -> set[str]:
    """Every name a scrape may show: the families and their series."""
    return {name for m in all_metrics() for name in (m.name, *m.series)}


def page() -> str:
    out = [
        "# Metrics",
        "",
        "Every metric a node and a router export on `GET /metrics`, generated when the site "
        "is built from their definitions (`node/runtime/metrics.py`, `node/router/metrics.py`); "
        "a test checks the list against a live node, speculating, and a router. The node's "
        "use vLLM's names, so dashboards and autoscalers made for vLLM work; ours are named "
        "`pagedllm:*`. A node labels every series `model_name`. The router's counters and "
        "histograms also come with prometheus-client's `NAME_created`, the time the series "
        "began. [Observability](../guide/observability.md) says how to read them.",
        "",
    ]
    for process, title in (("node", "Node (`pagedllm serve`)"), ("router", "Router")):
        rows = [
            [
                anchored(m.name, f"`{m.series[0] if m.type == 'counter' else m.name}`"),
                m.type,
                ", ".join(f"`{label}`" for label in m.labels),
                cell(m.help),
            ]
            for m in all_metrics()
            if m.process == process
        ]
        out += [f"## {title}", ""] + table(["metric", "type", "labels", "meaning"], rows) + [""]
    return "\n".join(out)


def pages() -> dict[str, str]:
    return {"reference/metrics.md": page()}
