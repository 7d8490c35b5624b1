"""Llama 3.1 / 3.2 / 3.3 JSON format: the reply is the call(s) themselves,
``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>`` and separated by
``;``."""

from __future__ import annotations

import json

from pagedllm.api.tool_parsers.base import (
    ParsedOutput,
    PartialOutput,
    call_from_object,
    json_values,
    partial_calls,
)

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

    def parse_partial(self, text: str) -> PartialOutput:
        body = text.lstrip()
        if PYTHON_TAG.startswith(body):  # not yet known whether calls or text follow
            return PartialOutput("")
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :].lstrip()
        if not body:
            return PartialOutput("")
        if not body.startswith("{"):
            return PartialOutput(text)
        output = PartialOutput("")
        for value in _value_texts(body):
            output.calls += partial_calls(value, ("parameters", "arguments"))
        return output


def _value_texts(text: str) -> list[str]:
    """The texts of the JSON values separated by ``;`` in ``text``, the last one maybe cut."""
    decoder = json.JSONDecoder()
    texts, i = [], 0
    while i < len(text):
        try:
            _, end = decoder.raw_decode(text, i)
        except ValueError:
            texts.append(text[i:])
            break
        texts.append(text[i:end])
        i = end
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
    return texts
