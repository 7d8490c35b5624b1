"""What a tool-call parser gives back, and the JSON helpers the parsers share."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from partial_json_parser import Allow
from partial_json_parser import loads as partial_loads

# A partial value as far as it is known: strings may be cut short, while a number or a
# literal (``1`` of ``12``, ``tr`` of ``true``) is left out until it is complete.
PARTIAL_STRINGS = Allow.STR | Allow.OBJ | Allow.ARR
# Only complete strings: a name is known once its closing quote is written.
COMPLETE_STRINGS = Allow.OBJ | Allow.ARR


@dataclass
class ToolCall:
    name: str
    # The arguments as JSON text (OpenAI's ``function.arguments``).
    arguments: str


@dataclass
class ParsedOutput:
    """An assistant reply split into its text and its tool calls."""

    content: str | None
    calls: list[ToolCall] = field(default_factory=list)


@dataclass
class PartialCall:
    """A call as far as a growing output shows it: its name once complete, and its arguments
    object as far as it is written (None before it starts)."""

    name: str | None
    arguments: dict[str, Any] | None = None


@dataclass
class PartialOutput:
    """A growing reply: the text that is surely content so far, and the calls begun."""

    content: str
    calls: list[PartialCall] = field(default_factory=list)


class ToolParser(Protocol):
    name: str

    def parse(self, text: str) -> ParsedOutput:
        """The calls in ``text``; none (all of it content) when it holds no well-formed call."""

    def parse_partial(self, text: str) -> PartialOutput:
        """What the first part of a reply, ``text``, shows so far (for streaming)."""


def call_from_object(value: Any, arguments_keys: tuple[str, ...] = ("arguments",)) -> ToolCall:
    """A call from ``{"name": ..., "arguments": {...}}``; ``ValueError`` if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise ValueError("a tool call is an object with a name")
    arguments: Any = {}
    for key in arguments_keys:
        if key in value:
            arguments = value[key]
            break
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError("a tool call's arguments are an object")
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def json_values(text: str, separators: str = "") -> list[Any]:
    """The JSON values written one after another in ``text`` (whitespace and any of
    ``separators`` between them); ``ValueError`` if anything else is there."""
    decoder = json.JSONDecoder()
    values, i = [], 0
    skip = " \t\r\n" + separators
    while True:
        while i < len(text) and text[i] in skip:
            i += 1
        if i == len(text):
            return values
        value, i = decoder.raw_decode(text, i)
        values.append(value)


def partial_json(text: str, allow: Allow) -> Any:
    """The value that the start of a JSON text, ``text``, shows so far; None if none."""
    try:
        return partial_loads(text, allow)
    except (ValueError, RecursionError):
        return None


def partial_call(
    named: Any, value: Any, arguments_keys: tuple[str, ...] = ("arguments",)
) -> PartialCall:
    """A call from the same partial ``{"name": ..., "arguments": {...}}`` read twice: ``named``
    with complete strings only, ``value`` with cut strings too."""
    if not isinstance(named, dict) or not isinstance(named.get("name"), str):
        return PartialCall(None)
    arguments = None
    if isinstance(value, dict):
        arguments = next((value[k] for k in arguments_keys if k in value), None)
    return PartialCall(named["name"], arguments if isinstance(arguments, dict) else None)


def partial_calls(text: str, arguments_keys: tuple[str, ...] = ("arguments",)) -> list[PartialCall]:
    """The calls begun in the start of one JSON call object or list of them."""
    named, value = partial_json(text, COMPLETE_STRINGS), partial_json(text, PARTIAL_STRINGS)
    if isinstance(named, list) and isinstance(value, list):
        return [partial_call(n, v, arguments_keys) for n, v in zip(named, value, strict=False)]
    return [partial_call(named, value, arguments_keys)]


def shown_content(text: str, marker: str) -> str:
    """``text`` less any end of it that may be the start of ``marker`` (held back, since the
    next piece may complete it)."""
    for size in range(min(len(marker), len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return text[:-size]
    return text
