"""The store's change events and the watchers that receive them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from pagedllm_testing.emulator.selectors import Selection


@dataclass
class WatchEvent:
    resource_version: int
    rtype_key: tuple[str, str]
    type: str
    obj: dict[str, Any]
    old: dict[str, Any] | None


@dataclass
class Watcher:
    rtype_key: tuple[str, str]
    selection: Selection
    queue: asyncio.Queue[WatchEvent | None]  # None: the server is stopping


def translate(event: WatchEvent, selection: Selection) -> tuple[str, dict[str, Any]] | None:
    """What a watcher with a selector sees: objects moving into or out of the selection show
    up as ADDED or DELETED."""
    now_matches = selection.matches(event.obj)
    before_matched = event.old is not None and selection.matches(event.old)
    if event.type == "DELETED":
        return ("DELETED", event.obj) if now_matches else None
    if now_matches and not before_matched:
        return ("ADDED", event.obj)
    if now_matches:
        return (event.type, event.obj)
    if before_matched:
        return ("DELETED", event.obj)
    return None
