"""The tool-call parsers on each family's format, and on text that holds no call."""

from __future__ import annotations

import json

import pytest

from pagedllm.api.tool_parsers import PARSERS, ToolCall


def _calls(parser: str, text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    parsed = PARSERS[parser].parse(text)
    return parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def test_hermes() -> None:
    text = (
        'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "time", "arguments": {}}'
    )
    assert _calls("hermes", text) == ("Let me look.", [("weather", {"city": "Oslo"}), ("time", {})])


def test_llama3_json() -> None:
    text = (
        '<|python_tag|>{"name": "weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "time", "parameters": {}}'
    )
    assert _calls("llama3_json", text) == (None, [("weather", {"city": "Oslo"}), ("time", {})])


@pytest.mark.parametrize(
    "text",
    [
        '[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Oslo"}}]',
        '[TOOL_CALLS]weather[ARGS]{"city": "Oslo"}',
    ],
)
def test_mistral(text: str) -> None:
    assert _calls("mistral", text) == (None, [("weather", {"city": "Oslo"})])


@pytest.mark.parametrize("parser", sorted(PARSERS))
@pytest.mark.parametrize(
    "text",
    [
        "Just words.",
        '<tool_call>{"name": "x", "arguments": [1]}</tool_call>',
        "<tool_call>{not json",
        '{"no": "name"}',
        "[TOOL_CALLS] nothing",
    ],
)
def test_text_without_a_well_formed_call_is_content(parser: str, text: str) -> None:
    parsed = PARSERS[parser].parse(text)
    assert parsed.calls == []
    assert parsed.content == text


def test_arguments_are_json_text() -> None:
    parsed = PARSERS["hermes"].parse(
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    )
    assert parsed.calls == [ToolCall("f", '{"a": 1}')]
