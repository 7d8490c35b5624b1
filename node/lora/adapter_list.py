"""The adapter list ``[{"name", "uri", "preload"}]`` and its naming rule, one for the node's
``--lora-modules-file`` and the operator's ``spec.adapters`` (which the operator writes into
that very file), so that a list one accepts the other accepts too. Pure: no torch, no I/O."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

# An adapter's name is what requests put as their model and a label of the pods' metrics.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
ADAPTER_NAME_MAX = 128
FIELDS = ("name", "uri", "preload")

Uri = TypeVar("Uri")


class AdapterListError(ValueError):
    """The list cannot be served as written; the message names the entry and the field."""


@dataclass(frozen=True)
class ListedAdapter(Generic[Uri]):
    name: str
    uri: Uri  # as the reader's ``read_uri`` gave it back
    # Served before the node reports ready; the others are added once it serves.
    preload: bool = False


def adapter_name_problem(name: Any) -> str | None:
    """Why ``name`` cannot name an adapter, or None when it can."""
    if isinstance(name, str) and len(name) <= ADAPTER_NAME_MAX and ADAPTER_NAME.fullmatch(name):
        return None
    return (
        f"{name!r} is not an adapter name (letters, digits, '-', '_' and '.', starting and "
        f"ending with a letter or digit, at most {ADAPTER_NAME_MAX})"
    )


def parse_adapter_list(
    raw: Any, where: str, read_uri: Callable[[Any, str], Uri]
) -> tuple[ListedAdapter[Uri], ...]:
    """The adapters of ``raw`` (the list as JSON gives it), names valid and unique; else
    AdapterListError naming the first problem. ``where`` names the list in messages, and
    ``read_uri(uri, where_of_the_entry)`` checks an entry's uri in the reader's grammar."""
    if not isinstance(raw, list):
        raise AdapterListError(f"{where} must be a list of {{name, uri, preload}}")
    adapters: list[ListedAdapter[Uri]] = []
    for index, item in enumerate(raw):
        at = f"{where}[{index}]"
        if not isinstance(item, Mapping):
            raise AdapterListError(f"{at} must be an object with name, uri and preload")
        unknown = sorted(set(item) - set(FIELDS))
        if unknown:
            raise AdapterListError(f"{at}: unknown fields {unknown}; known: name, uri, preload")
        name, preload = item.get("name"), item.get("preload")
        problem = adapter_name_problem(name)
        if problem is not None:
            raise AdapterListError(f"{at}.name: {problem}")
        if any(adapter.name == name for adapter in adapters):
            raise AdapterListError(f"{at}.name: {name!r} is given twice")
        uri = read_uri(item.get("uri"), at)
        if preload is None:  # a null, as the operator's spec may hold: the default
            preload = False
        if not isinstance(preload, bool):
            raise AdapterListError(f"{at}.preload must be true or false, got {preload!r}")
        adapters.append(ListedAdapter(name, uri, preload))
    return tuple(adapters)
