"""Waiting for a condition in tests that drive asynchronous controllers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(
    probe: Callable[[], T | None],
    timeout: float = 10.0,
    what: str = "condition",
    interval: float = 0.25,
) -> T:
    """Poll until probe() returns something truthy; fail with the last value otherwise."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; last: {last!r}")
