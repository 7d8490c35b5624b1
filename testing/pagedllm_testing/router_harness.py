"""Real serving nodes and a real `pagedllm router` process in front of them, for the tests and
the fleet benchmark's checks."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from pagedllm_testing.serve_harness import Server, start_command


def start_router(
    tmp_dir: Path, model_dir: str, backends: list[str], *args: str, api_key: str | None = None
) -> Server:
    """`pagedllm router` over the ``backends`` URLs, once its /health answers (which never
    waits for the backends: see ready_backends)."""
    urls = ",".join(backends)
    return start_command(
        tmp_dir, "router", "--model", model_dir, "--backends", urls, *args, api_key=api_key
    )


def ready_backends(router: Server) -> int:
    return int(router.metric("pagedllm:router_backend_ready"))


def wait_for(predicate: Callable[[], bool], router: Server, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{router.log()[-3000:]}")
        time.sleep(0.1)
