"""Tool calling: what ``tool_choice`` asks for, the grammar that makes a forced call always
parse, and the calls read back from the output.

``required`` and a named function are constrained (vLLM's way): a named call's output is its
arguments, following the function's parameter schema; ``required`` writes a JSON list of
``{"name", "parameters"}`` objects, one of the tools each. ``auto`` leaves the model free and
reads its calls with the ``--tool-call-parser`` of its family.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from pagedllm.api.chat_settings import ChatSettings
from pagedllm.api.protocol import ChatCompletionRequest, ChatTool, NamedToolChoice
from pagedllm.api.tool_parsers import PARSERS, ParsedOutput, ToolCall, ToolParser
from pagedllm.api.tool_parsers.base import (
    PARTIAL_STRINGS,
    PartialCall,
    PartialOutput,
    call_from_object,
    partial_calls,
    partial_json,
)
from pagedllm.sampling_params import StructuredOutputsParams

NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolChoiceError(ValueError):
    pass


@dataclass
class ToolPlan:
    """How this request's tool calls are made and read."""

    mode: str  # "required", "named" or "auto"
    tools: list[ChatTool]
    parallel: bool = True
    name: str | None = None
    parser: ToolParser | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar of a forced call (None for auto)."""
        if self.mode == "named":
            (tool,) = [t for t in self.tools if t.function.name == self.name]
            return StructuredOutputsParams(json=tool.function.parameters or NO_PARAMETERS)
        if self.mode == "required":
            return StructuredOutputsParams(json=self._calls_schema())
        return None

    def _calls_schema(self) -> dict[str, Any]:
        one_of_the_tools = [
            {
                "type": "object",
                "properties": {
                    "name": {"enum": [t.function.name]},
                    "parameters": t.function.parameters or NO_PARAMETERS,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        schema: dict[str, Any] = {
            "type": "array",
            "items": {"anyOf": one_of_the_tools},
            "minItems": 1,
        }
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def read(self, text: str) -> ParsedOutput:
        """The reply's text and calls; all text when it holds no call that parses (an output
        cut short by max_tokens)."""
        try:
            if self.mode == "named":
                assert self.name is not None
                return ParsedOutput(
                    None, [call_from_object({"name": self.name, "arguments": text})]
                )
            if self.mode == "required":
                listed = json.loads(text)
                if not isinstance(listed, list):
                    return ParsedOutput(text)
                return ParsedOutput(None, [call_from_object(v, ("parameters",)) for v in listed])
        except ValueError:
            return ParsedOutput(text)
        assert self.parser is not None
        return self.parser.parse(text)

    def read_partial(self, text: str) -> PartialOutput:
        """What the start of a reply, ``text``, shows so far: ``read`` for streaming."""
        if self.mode == "named":
            arguments = partial_json(text, PARTIAL_STRINGS)
            return PartialOutput(
                "", [PartialCall(self.name, arguments if isinstance(arguments, dict) else None)]
            )
        if self.mode == "required":
            return PartialOutput("", partial_calls(text, ("parameters",)))
        assert self.parser is not None
        return self.parser.parse_partial(text)


def plan_tools(body: ChatCompletionRequest, settings: ChatSettings) -> ToolPlan | None:
    """The request's tool plan; None when no tool may be called. ``ToolChoiceError`` for a
    choice that cannot be served."""
    tools = body.tools or []
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise ToolChoiceError("tool_choice needs tools")
    parallel = body.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in {t.function.name for t in tools}:
            raise ToolChoiceError(f"tool_choice names {name!r}, which is not one of the tools")
        return ToolPlan("named", tools, parallel, name=name)
    if choice == "required":
        return ToolPlan("required", tools, parallel)
    if not settings.enable_auto_tool_choice or settings.tool_call_parser is None:
        raise ToolChoiceError(
            '"auto" tool choice needs the server started with --enable-auto-tool-choice and '
            "--tool-call-parser"
        )
    return ToolPlan("auto", tools, parallel, parser=PARSERS[settings.tool_call_parser])


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_calls_json(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """OpenAI's ``message.tool_calls``."""
    return [
        {
            "id": tool_call_id(),
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call in calls
    ]
