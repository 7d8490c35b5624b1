"""Llama 3.1 / 3.2 / 3.3 JSON format: the reply is the call(s) themselves,
``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>`` and separated by
``;``."""

from __future__ import annotations

from pagedllm.api.tool_parsers.base import ParsedOutput, call_from_object, json_values

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser:
    name = "llama3_json"

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :]
        if not body.lstrip().startswith("{"):
            return ParsedOutput(text)
        try:
            values = json_values(body, separators=";")
            calls = [call_from_object(v, ("parameters", "arguments")) for v in values]
        except ValueError:
            return ParsedOutput(text)
        return ParsedOutput(None, calls)
