"""Hermes format (Qwen2.5, Qwen3, Hermes 2/3, and the built-in tool template): each call is
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, after optional text."""

from __future__ import annotations

import json
import re

from pagedllm.api.tool_parsers.base import (
    PartialCall,
    ToolCall,
    call_from_object,
    partial_calls,
    shown_content,
)
from pagedllm.api.tool_parsers.tagged import TaggedParser

START = "<tool_call>"
END = "</tool_call>"
# The last call may lack its closing tag when the model stopped on its end token.
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesParser(TaggedParser):
    name = "hermes"
    start = START

    def calls(self, text: str) -> list[ToolCall]:
        return [call_from_object(json.loads(body)) for body in _CALL.findall(text)]

    def partial_calls(self, text: str) -> list[PartialCall]:
        return [
            call for body in _CALL.findall(text) for call in partial_calls(shown_content(body, END))
        ]
