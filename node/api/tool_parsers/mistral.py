"""Mistral format: ``[TOOL_CALLS]`` and then either a JSON list of
``{"name": ..., "arguments": {...}}`` (v3 tokenizers) or ``name[ARGS]{...}`` per call (v11+)."""

from __future__ import annotations

import json

from pagedllm.api.tool_parsers.base import (
    PARTIAL_STRINGS,
    PartialCall,
    ToolCall,
    call_from_object,
    json_values,
    partial_calls,
    partial_json,
)
from pagedllm.api.tool_parsers.tagged import TaggedParser

START = "[TOOL_CALLS]"
ARGS = "[ARGS]"


class MistralParser(TaggedParser):
    name = "mistral"
    start = START

    def calls(self, text: str) -> list[ToolCall]:
        calls: list[ToolCall] = []
        for part in text.split(START)[1:]:
            part = part.strip()
            if part.startswith("["):
                (listed,) = json_values(part)
                if not isinstance(listed, list):
                    raise ValueError("[TOOL_CALLS] is followed by a list")
                calls += [call_from_object(v) for v in listed]
            elif ARGS in part:
                name, arguments = part.split(ARGS, 1)
                calls.append(
                    call_from_object({"name": name.strip(), "arguments": json.loads(arguments)})
                )
            else:
                raise ValueError("no calls after [TOOL_CALLS]")
        return calls

    def partial_calls(self, text: str) -> list[PartialCall]:
        calls: list[PartialCall] = []
        for part in text.split(START)[1:]:
            part = part.strip()
            if part.startswith("["):
                calls += partial_calls(part)
            elif ARGS in part:
                name, arguments = part.split(ARGS, 1)
                value = partial_json(arguments, PARTIAL_STRINGS)
                calls.append(PartialCall(name.strip(), value if isinstance(value, dict) else None))
        return calls
