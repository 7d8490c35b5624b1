"""What a tool-call parser gives back, and the JSON helpers the parsers share."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


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


class ToolParser(Protocol):
    name: str

    def parse(self, text: str) -> ParsedOutput:
        """The calls in ``text``; none (all of it content) when it holds no well-formed call."""


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


def calls_after(text: str, marker: str, read: Callable[[str], list[ToolCall]]) -> ParsedOutput:
    """Formats whose calls follow a ``marker`` after optional text: the text before it is the
    content, ``read`` gets the rest (from the marker on) and raises ``ValueError`` when it
    holds no well-formed calls, and then all of ``text`` is content."""
    start = text.find(marker)
    if start < 0:
        return ParsedOutput(text)
    try:
        calls = read(text[start:])
    except ValueError:
        return ParsedOutput(text)
    if not calls:
        return ParsedOutput(text)
    return ParsedOutput(text[:start].strip() or None, calls)
