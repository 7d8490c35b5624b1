"""Every flag, PagedLLM field and metric that a hand-written page or the README names exists:
flags in the parser of the command they are given to (or, named alone, in one of the project's
parsers), fields in the CRD's schema, metrics among the definitions the metrics reference is
generated from. So a renamed flag or field, or a metric that is gone, fails here rather than in
a reader's terminal."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from pagedllm_testing.docs_site import REPO, blocks, hook, inline_code, pages

# A command whose flags a page may name, and the words that start it.
PAGEDLLM = re.compile(r"\bpagedllm (serve|router|generate|download|demo-model|operator)\b(.*)")
MAKE_SERVE = re.compile(r"\bmake serve ARGS=\"([^\"]*)\"")
BENCH = re.compile(r"\bbench/(\w+)\.py\b(.*)")
FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")
METRIC = re.compile(r"\b(?:vllm|pagedllm):[a-z][a-z0-9_]*")
PATH = re.compile(r"^((?:spec|status)(?:\.[A-Za-z][A-Za-z0-9]*|\[\])+)")
CAMEL = re.compile(r"^[a-z]+(?:[A-Z][a-z0-9]*)+$")
PATCH = re.compile(r"kubectl patch pllm \S+ --type=merge -p '([^']*)'", re.DOTALL)


def argparse_flags(path: Path) -> set[str]:
    """The option strings of every ``add_argument`` call in a file, read without importing it
    (the benchmarks import torch)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            found |= {
                a.value
                for a in node.args
                if isinstance(a, ast.Constant) and str(a.value).startswith("-")
            }
    return found


@cache
def command_flags() -> dict[str, set[str]]:
    cli = hook("reference_cli")
    found = {
        name: cli.flag_names(cli.subcommand(name))
        for name in ("serve", "router", "generate", "download", "demo-model")
    }
    found["operator"] = cli.operator_names()
    for script in (REPO / "bench").glob("*.py"):
        found[f"bench/{script.stem}"] = argparse_flags(script)
    return found


@cache
def every_flag() -> set[str]:
    """The flags of the project's own commands, the test support's included."""
    found = set().union(*command_flags().values())
    for script in (REPO / "testing" / "pagedllm_testing").rglob("*.py"):
        found |= argparse_flags(script)
    return found | {"-h", "--help"}


def flags_of(words: str) -> list[str]:
    """The flags in a command's words, up to a comment, a pipe or the next command."""
    words = re.split(r"\s#|[|;&]", words)[0]
    return [f.split("=")[0] for f in FLAG.findall(words)]


def commands(text: str) -> Iterator[tuple[str, list[str]]]:
    """(command, the flags given to it) for each command line of a page, in its blocks and its
    inline code, a line continued by a backslash taken whole."""
    sources = [b.text for b in blocks(text) if b.language in ("sh", "bash", "")]
    for source in [*sources, *inline_code(text)]:
        for line in source.replace("\\\n", " ").splitlines():
            for match in MAKE_SERVE.finditer(line):
                yield "serve", flags_of(match[1])
            # Each command of the line: they part at the shell's separators.
            for part in re.split(r"[;&|]", re.split(r"\s#", line)[0]):
                for match in PAGEDLLM.finditer(part):
                    yield match[1], flags_of(match[2])
                for match in BENCH.finditer(part):
                    yield f"bench/{match[1]}", flags_of(match[2])


def test_every_flag_given_to_a_command_is_one_of_its_own() -> None:
    known = command_flags()
    given = [
        (page, command, flag)
        for page, text in pages().items()
        for command, flags in commands(text)
        for flag in flags
    ]
    assert len(given) > 30, "the pages' commands were not found"
    wrong = [
        f"{page}: {command} {flag}" for page, command, flag in given if flag not in known[command]
    ]
    assert not wrong


def test_every_flag_named_alone_exists() -> None:
    known = every_flag()
    named = [
        (page, span, flag)
        for page, text in pages().items()
        for span in inline_code(text)
        if span.startswith("-")
        for flag in flags_of(span)
    ]
    assert len(named) > 50, "the pages' flags were not found"
    assert not [f"{page}: `{span}`" for page, span, flag in named if flag not in known]


# ------------------------------------------------------------------------------ the CRD


@cache
def schema() -> dict[str, Any]:
    return hook("reference_crd").version_schema()[1]


def resolves(path: list[str]) -> bool:
    """Whether a field path (`spec`, `router`, `loadBound`; `[]` for an array's items) is in
    the schema; a map's keys and free-form objects take any name."""
    node = schema()
    for part in path:
        if node.get("x-kubernetes-preserve-unknown-fields"):
            return True
        if part == "[]":
            if "items" not in node:
                return False
            node = node["items"]
        elif part in node.get("properties", {}):
            node = node["properties"][part]
        elif isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        else:
            return False
    return True


def keys(value: Any, path: list[str]) -> Iterator[list[str]]:
    """Every key path of a YAML or JSON value."""
    if isinstance(value, dict):
        for key, child in value.items():
            yield [*path, key]
            yield from keys(child, [*path, key])
    elif isinstance(value, list):
        for item in value:
            yield from keys(item, [*path, "[]"])


def resource_documents(text: str) -> Iterator[dict[str, Any]]:
    """The PagedLLMs of a page's YAML blocks (a fragment with `spec:` but no kind counts too),
    and the bodies of its `kubectl patch pllm` commands."""
    for block in blocks(text):
        if block.language == "yaml":
            for doc in yaml.safe_load_all(block.text):
                if isinstance(doc, dict) and doc.get("kind", "PagedLLM") == "PagedLLM":
                    yield {k: v for k, v in doc.items() if k in ("spec", "status")}
    for body in PATCH.findall(text):
        yield json.loads(body)


def field_names() -> set[str]:
    """Every field name and enum value of the schema."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            found.update(node.get("properties", {}))
            found.update(str(v) for v in node.get("enum", []))
            for child in node.values():
                walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)

    walk(schema())
    return found


def test_every_field_path_a_page_names_is_in_the_crd() -> None:
    named: list[tuple[str, list[str]]] = []
    for page, text in pages().items():
        for span in inline_code(text):
            match = PATH.match(span)
            if match:
                named.append((page, re.findall(r"\[\]|[^.\[\]]+", match[1])))
        for doc in resource_documents(text):
            named += [(page, path) for path in keys(doc, [])]
    assert len(named) > 60, "the pages' fields were not found"
    assert not [f"{page}: {'.'.join(path)}" for page, path in named if not resolves(path)]


def test_every_field_name_a_kubernetes_page_names_alone_is_in_the_crd() -> None:
    """A camelCase name in inline code on the Kubernetes pages is a PagedLLM field or an enum
    value (Kubernetes' own fields are named with their object: `metadata.generation`)."""
    named = [
        (page, span.split(":")[0])
        for page, text in pages().items()
        if page.startswith("docs/kubernetes/") or page == "README.md"
        for span in inline_code(text)
        if CAMEL.match(span.split(":")[0])
    ]
    assert named, "the pages' field names were not found"
    assert not [f"{page}: `{name}`" for page, name in named if name not in field_names()]


# ------------------------------------------------------------------------------ metrics


def test_every_metric_a_page_names_is_defined() -> None:
    defined = hook("reference_metrics").series_names()
    named = [(page, name) for page, text in pages().items() for name in set(METRIC.findall(text))]
    assert len(named) > 25, "the pages' metrics were not found"
    assert not [f"{page}: {name}" for page, name in named if name not in defined]


# ------------------------------------------------------------------------------ the checks


@pytest.mark.parametrize(
    ("text", "found"),
    [
        (
            "```sh\npagedllm serve --model m \\\n    --port 9 &  pagedllm router --policy x\n```",
            [("serve", ["--model", "--port"]), ("router", ["--policy"])],
        ),
        ('`make serve ARGS="--kv-cache-memory 1"`', [("serve", ["--kv-cache-memory"])]),
        ("`python bench/fleet.py --parts a,b` # `--no`", [("bench/fleet", ["--parts"])]),
        ("`kubectl scale --replicas=3`", []),
    ],
)
def test_commands_and_their_flags_are_found(text: str, found: list) -> None:
    assert list(commands(text)) == found


def test_paths_resolve_through_maps_and_arrays_only() -> None:
    assert resolves(["spec", "router", "loadBound"])
    assert resolves(["spec", "resources", "requests", "cpu"])  # a map's key
    assert resolves(["spec", "env", "[]", "valueFrom", "secretKeyRef"])  # free-form
    assert not resolves(["spec", "router", "loadbound"])
    assert not resolves(["spec", "engine", "[]"])
