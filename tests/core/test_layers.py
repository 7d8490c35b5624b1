"""Imports go one way: down the layers below, read from every module's source.

Each module of ``node/``, ``kernels/`` and ``operator/`` belongs to a unit: a subpackage
(``pagedllm.core``), a top-level module (``pagedllm.config``) or the package's own
``__init__`` (``pagedllm``). A module may import from its own unit and from the units of any
lower layer; the units of one layer import nothing of each other. Every import counts: those
inside functions (imported late to keep a process light are still a dependency) and those
under ``TYPE_CHECKING`` (a type in a signature is one too). docs/contributing.md states the
same order in words.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from pagedllm_testing.layout import module_of, source_files

# Bottom first.
LAYERS: tuple[tuple[str, ...], ...] = (
    # Values: constants and value types that import nothing of the project.
    ("pagedllm.version", "pagedllm.sampling_params", "pagedllm.cache", "pagedllm.hub"),
    # The engine core: scheduling, the KV blocks' bookkeeping, step plans, the LoRA request.
    ("pagedllm.core",),
    # What the core's work travels and is computed as: outputs, messages, grammars, kernels,
    # adapters.
    (
        "pagedllm.outputs",
        "pagedllm.ipc",
        "pagedllm.structured",
        "pagedllm.kernels",
        "pagedllm.lora",
    ),
    # Models; text out of tokens; what the node's and the router's processes share.
    ("pagedllm.models", "pagedllm.output", "pagedllm.runtime"),
    # The engine's settings (which name the model to load).
    ("pagedllm.config",),
    # One rank's model runner.
    ("pagedllm.worker",),
    # The HTTP front and the offline engine.
    ("pagedllm.api", "pagedllm.llm_engine"),
    # The router, the offline LLM, the operator.
    ("pagedllm.router", "pagedllm.llm", "pagedllm.operator"),
    # The node's processes: their entry points, the supervisor, the flags.
    ("pagedllm.serve",),
    # The package's face (``from pagedllm import LLM``), then the command line.
    ("pagedllm",),
    ("pagedllm.cli",),
)


@dataclass(frozen=True)
class Edge:
    source: str  # the importing module
    target: str  # the module imported (or the package a name is imported from)
    line: int


def project_sources() -> dict[str, tuple[str, bool]]:
    """Every module of the project: its name -> (its source, whether it is a package)."""
    return {module_of(p): (p.read_text(), p.name == "__init__.py") for p in source_files()}


def import_edges(sources: dict[str, tuple[str, bool]]) -> list[Edge]:
    """Every import of a ``pagedllm`` module, anywhere in a module's body."""
    edges = []
    for name, (text, is_package) in sources.items():
        package = name if is_package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                # ``from pagedllm import sampling_params`` imports a module, ``from pagedllm
                # import LLM`` a name of the package.
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in sources else base
                    for alias in node.names
                ]
            else:
                continue
            edges += [
                Edge(name, target, node.lineno)
                for target in dict.fromkeys(targets)
                if target == "pagedllm" or target.startswith("pagedllm.")
            ]
    return edges


def unit_of(module: str, layers: tuple[tuple[str, ...], ...]) -> str | None:
    """The unit a module belongs to: the longest one that names it or a package above it
    (the package ``pagedllm`` holds only its ``__init__``)."""
    units = [u for layer in layers for u in layer]
    owners = [u for u in units if module == u or (u != "pagedllm" and module.startswith(u + "."))]
    return max(owners, key=len, default=None)


def layering_problems(
    sources: dict[str, tuple[str, bool]], layers: tuple[tuple[str, ...], ...]
) -> list[str]:
    """What breaks the order: a module in no unit, an import of a unit not below, and (said
    on its own) any two units that import each other."""
    level = {unit: i for i, layer in enumerate(layers) for unit in layer}
    problems = [f"{m} is in no layer" for m in sources if unit_of(m, layers) is None]
    pairs: dict[tuple[str, str], Edge] = {}
    for edge in import_edges(sources):
        source, target = unit_of(edge.source, layers), unit_of(edge.target, layers)
        if source is None or source == target:
            continue
        if target is None:
            problems.append(f"{edge.source}:{edge.line} imports {edge.target}, in no layer")
            continue
        pairs.setdefault((source, target), edge)
        if level[target] >= level[source]:
            where = "the same layer" if level[target] == level[source] else "a higher layer"
            problems.append(
                f"{edge.source}:{edge.line} imports {edge.target} ({target}, {where} than {source})"
            )
    for (a, b), edge in sorted(pairs.items()):
        if a < b and (b, a) in pairs:
            back = pairs[(b, a)]
            problems.append(
                f"{a} and {b} import each other: {edge.source}:{edge.line} imports "
                f"{edge.target}, {back.source}:{back.line} imports {back.target}"
            )
    return problems


def test_every_import_goes_down_the_layers() -> None:
    sources = project_sources()
    assert "pagedllm.core.scheduler" in sources and "pagedllm.operator.spec" in sources
    assert layering_problems(sources, LAYERS) == []


def test_every_layer_unit_exists() -> None:
    sources = project_sources()
    for unit in (u for layer in LAYERS for u in layer):
        assert any(m == unit or m.startswith(unit + ".") for m in sources), unit


def fake(**modules: str) -> dict[str, tuple[str, bool]]:
    """A tiny module set: ``core__a="..."`` is the module ``pagedllm.core.a``."""
    return {"pagedllm." + k.replace("__", "."): (v, False) for k, v in modules.items()}


FAKE_LAYERS = (("pagedllm.core",), ("pagedllm.api", "pagedllm.router"), ("pagedllm.serve",))


def test_the_checker_passes_imports_down_and_within_a_unit() -> None:
    sources = fake(
        core__a="import os\n",
        core__b="from pagedllm.core import a\nfrom . import a as again\n",
        api__c="from pagedllm.core.a import X\n",
        serve__d="import pagedllm.api.c\nfrom ..core import a\n",
    )
    assert layering_problems(sources, FAKE_LAYERS) == []


def test_the_checker_fails_a_back_edge_even_a_late_one() -> None:
    sources = fake(
        core__a="def f():\n    from pagedllm.serve.d import run\n    return run\n",
        serve__d="from pagedllm.core.a import f\n",
    )
    problems = layering_problems(sources, FAKE_LAYERS)
    assert any("pagedllm.core.a:2 imports pagedllm.serve.d" in p for p in problems), problems
    assert any("pagedllm.core and pagedllm.serve import each other" in p for p in problems)


def test_the_checker_fails_an_import_within_a_layer_and_a_relative_back_edge() -> None:
    sources = fake(
        api__c="from pagedllm.router.e import Y\n",
        router__e="import os\n",
        core__a="from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..api import c\n",
    )
    problems = layering_problems(sources, FAKE_LAYERS)
    assert any(
        "pagedllm.api.c:1 imports pagedllm.router.e" in p and "same layer" in p for p in problems
    )
    assert any("pagedllm.core.a:3 imports pagedllm.api.c" in p for p in problems), problems


def test_the_checker_fails_a_module_in_no_layer() -> None:
    sources = fake(worker__x="from pagedllm.core.a import f\n", core__a="")
    assert layering_problems(sources, FAKE_LAYERS) == ["pagedllm.worker.x is in no layer"]
