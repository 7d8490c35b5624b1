"""The PagedLLM operator: reconciles PagedLLM resources into serving Deployments.

Run it with `kopf run -m pagedllm.operator` or `pagedllm operator` (see `run`). Importing
this package registers the kopf handlers.
"""

from __future__ import annotations

import click
from kopf import cli

from pagedllm.operator import handlers as handlers

__all__ = ["run"]


def run(argv: list[str] | None = None) -> int:
    """`pagedllm operator [KOPF RUN OPTIONS]`: kopf's own `run` command on this package
    (e.g. --namespace, --liveness, --verbose). Without --namespace/-n or --all-namespaces/-A
    it serves all namespaces."""
    args = list(argv or [])
    scoped = any(
        arg in ("-A", "--all-namespaces") or arg.startswith(("-n", "--namespace")) for arg in args
    )
    if not scoped:
        args.append("--all-namespaces")
    try:
        cli.main(["run", "-m", "pagedllm.operator", *args], standalone_mode=False)
    except click.ClickException as error:
        error.show()
        return error.exit_code
    except click.exceptions.Abort:
        return 1
    return 0
