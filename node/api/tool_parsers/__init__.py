"""Tool-call parsers (``--tool-call-parser``): each finds the calls in one model family's
output format. Plain text processing, no torch."""

from __future__ import annotations

from pagedllm.api.tool_parsers.base import ParsedOutput, ToolCall, ToolParser
from pagedllm.api.tool_parsers.hermes import HermesParser
from pagedllm.api.tool_parsers.llama3_json import Llama3JsonParser
from pagedllm.api.tool_parsers.mistral import MistralParser

PARSERS: dict[str, ToolParser] = {
    p.name: p for p in (HermesParser(), Llama3JsonParser(), MistralParser())
}

__all__ = ["PARSERS", "ParsedOutput", "ToolCall", "ToolParser"]
