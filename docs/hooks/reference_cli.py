"""The command-line references, read from the parsers themselves: `pagedllm serve` and
`pagedllm router` from the argparse parser the CLI builds (`pagedllm.cli.build_parser`), the
operator's options from kopf's `run` command, which `pagedllm operator` passes them to, and its
settings from `OperatorConfig`'s fields and the comments above them."""

from __future__ import annotations

import argparse
import ast
import inspect
from dataclasses import dataclass, fields

from reference_tables import cell, table


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # every spelling: --tensor-parallel-size, -tp
    value: str  # what follows the flag (metavar or choices), "" for a switch
    default: str
    help: str


def subcommand(name: str) -> argparse.ArgumentParser:
    """The parser of `pagedllm NAME` (importing the CLI starts nothing and loads no torch)."""
    from pagedllm.cli import build_parser

    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise LookupError(f"pagedllm has no subcommand {name}")


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices is not None:
        return "{" + ",".join(str(c) for c in action.choices) + "}"
    metavar = action.metavar or action.dest.upper()
    return f"{metavar} ..." if action.nargs in ("+", "*") else str(metavar)


def _default(action: argparse.Action) -> str:
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if action.default else "off"
    if action.nargs == 0:
        return "off"
    return "–" if action.default is None else f"`{action.default}`"


def flags(parser: argparse.ArgumentParser) -> list[Flag]:
    """Every option of ``parser`` but --help, in the order they were added."""
    return [
        Flag(tuple(a.option_strings), _value(a), _default(a), a.help or "")
        for a in parser._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction)
    ]


def flag_names(parser: argparse.ArgumentParser) -> set[str]:
    return {name for flag in flags(parser) for name in flag.names}


def flags_table(items: list[Flag]) -> str:
    # kopf's options carry no help text: their table has no meaning column.
    helped = any(flag.help for flag in items)
    rows = []
    for flag in items:
        row = [", ".join(f"`{n}`" for n in flag.names), f"`{flag.value}`" if flag.value else ""]
        rows.append([*row, cell(flag.default), *([cell(flag.help)] if helped else [])])
    return "\n".join(table(["flag", "value", "default", *(["meaning"] if helped else [])], rows))


def command_page(name: str, intro: str) -> str:
    parser = subcommand(name)
    return (
        f"# pagedllm {name}\n\n{intro}\n\n"
        f"Generated from the command's argument parser when the site is built; "
        f"`pagedllm {name} --help` prints the same.\n\n{flags_table(flags(parser))}\n"
    )


# ---------------------------------------------------------------- the operator


def operator_options() -> list[Flag]:
    """The options of kopf's `run` command: `pagedllm operator` runs it on our package (with
    `--all-namespaces` unless a namespace is named)."""
    import click
    from kopf import cli

    # click 8.3 marks an option without a default by a sentinel of its own.
    unset = getattr(click.core, "UNSET", None)
    run = cli.main.commands["run"]
    found = []
    for param in run.params:
        if not param.opts[0].startswith("-"):
            continue  # the positional paths: `pagedllm operator` names the package itself
        names = tuple(param.opts) + tuple(param.secondary_opts)
        value = "" if getattr(param, "is_flag", False) else param.type.name.upper()
        default = param.default
        shown = "–" if default is unset or default in (None, (), False) else f"`{default}`"
        found.append(Flag(names, value, shown, getattr(param, "help", None) or ""))
    return found


def operator_settings() -> list[tuple[str, str, str]]:
    """(environment variable, default, what it sets) for each field of OperatorConfig, its
    meaning taken from the comment above the field."""
    from pagedllm.operator.config import ENV_PREFIX, OperatorConfig

    source = inspect.getsource(OperatorConfig)
    lines = source.splitlines()
    comments: dict[str, str] = {}
    meaning = ""
    for node in ast.parse(source).body[0].body:  # type: ignore[attr-defined]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above: list[str] = []
            row = node.lineno - 2
            while row >= 0 and lines[row].strip().startswith("#"):
                above.insert(0, lines[row].strip().lstrip("#").strip())
                row -= 1
            # A field right below another shares its comment (backoff_seconds and _max_seconds).
            meaning = " ".join(above) or meaning
            comments[node.target.id] = meaning
    return [
        (ENV_PREFIX + f.name.upper(), f"`{f.default}`", comments.get(f.name, ""))
        for f in fields(OperatorConfig)
    ]


def operator_page() -> str:
    settings = table(
        ["variable", "default", "meaning"],
        [[f"`{v}`", d, cell(m)] for v, d, m in operator_settings()],
    )
    return (
        "# pagedllm operator\n\n"
        "`pagedllm operator [OPTIONS]` runs the Kubernetes operator: kopf's `run` command on "
        "the package `pagedllm.operator` (the same as `kopf run -m pagedllm.operator`). Without "
        "`--namespace`/`-n` or `--all-namespaces`/`-A` it watches every namespace. See "
        "[Install](../kubernetes/install.md) for how it is deployed.\n\n"
        "Generated when the site is built, from kopf's command and the operator's settings.\n\n"
        "## Options\n\n"
        "kopf's own (its documentation says what each does); `pagedllm operator` sets "
        "`--module` itself.\n\n"
        f"{flags_table(operator_options())}\n\n"
        "## Settings\n\n"
        "Environment variables, read once at start (the manifests set them; the end-to-end "
        "tests shorten them):\n\n" + "\n".join(settings) + "\n"
    )


def operator_names() -> set[str]:
    return {name for flag in operator_options() for name in flag.names}


def pages() -> dict[str, str]:
    """Path under docs/ -> Markdown."""
    return {
        "reference/serve.md": command_page(
            "serve",
            "Runs one serving node: the OpenAI-compatible HTTP API in front of the paged-KV-cache "
            "engine (see [Serving](../guide/serving.md)). vLLM's flag names and meanings where "
            "vLLM has the flag.",
        ),
        "reference/router.md": command_page(
            "router",
            "An OpenAI-compatible front for several nodes that sends each request to the node "
            "caching the longest prefix of its prompt (see [Routing](../guide/routing.md)).",
        ),
        "reference/operator.md": operator_page(),
    }
