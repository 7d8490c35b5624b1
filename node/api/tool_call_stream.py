"""Streamed tool calls: OpenAI's incremental ``delta.tool_calls``, read from one choice's text
as it grows.

Each step re-reads the whole text so far with the plan's partial reader and sends what is new:
content that is surely not the start of a call; a call's first delta (``index``, ``id``,
``type``, ``function.name`` and ``arguments: ""``) once its name is complete; then pieces of
its arguments. The pieces are taken from the arguments as JSON text (the way the whole
response writes them), cut before anything that a later token may still change: the closing
quotes and brackets that only complete a partial value. At the end the whole text is read as
the non-streamed response reads it, and what is left of each call is sent, so the pieces add
up to the non-streamed response's calls.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from pagedllm.api.tool_calls import ToolPlan, tool_call_id

log = logging.getLogger(__name__)

# What ``json.dumps`` of a partial value ends with that the complete value may not.
_CLOSERS = '"]}'


def stable_arguments(arguments: dict[str, Any]) -> str:
    """The JSON text of partial ``arguments`` that the complete arguments' text starts with."""
    text = json.dumps(arguments, ensure_ascii=False).rstrip(_CLOSERS)
    # A cut string may end in the first half of a surrogate pair.
    if text and "\ud800" <= text[-1] <= "\udbff":
        text = text[:-1]
    return text


@dataclass
class _SentCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class ToolCallStream:
    """One streamed choice's text and what of it has been sent."""

    plan: ToolPlan
    text: str = ""
    content: str = ""
    calls: list[_SentCall] = field(default_factory=list)

    def feed(self, piece: str) -> list[dict[str, Any]]:
        """The deltas that the choice's next ``piece`` of text lets out, each sent alone."""
        self.text += piece
        seen = self.plan.read_partial(self.text)
        deltas = [] if self.calls else self._content(seen.content)
        for index, call in enumerate(seen.calls):
            if call.name is None:  # calls are sent in order
                break
            if index == len(self.calls):
                deltas.append(self._open(call.name))
            if call.arguments is not None:
                deltas += self._arguments(index, stable_arguments(call.arguments))
        return deltas

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The last deltas, from the whole text read as the non-streamed response reads it,
        and the finish reason (``tool_calls`` when the choice stopped on calls)."""
        parsed = self.plan.read(self.text)
        if not parsed.calls:
            # A call cut short (by max_tokens) is content in the whole response; what was
            # streamed of it cannot be taken back.
            return ([] if self.calls else self._content(self.text)), finish_reason
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(parsed.calls):
            if index == len(self.calls):
                deltas.append(self._open(call.name))
            elif self.calls[index].name != call.name:
                log.warning(
                    "streamed tool call %d named %r, read as %r",
                    index,
                    self.calls[index].name,
                    call.name,
                )
            deltas += self._arguments(index, call.arguments)
        return deltas, "tool_calls" if finish_reason == "stop" else finish_reason

    def _content(self, content: str) -> list[dict[str, Any]]:
        if len(content) <= len(self.content) or not content.startswith(self.content):
            return []
        piece, self.content = content[len(self.content) :], content
        return [{"content": piece}]

    def _open(self, name: str) -> dict[str, Any]:
        call = _SentCall(tool_call_id(), name)
        self.calls.append(call)
        return {
            "tool_calls": [
                {
                    "index": len(self.calls) - 1,
                    "id": call.id,
                    "type": "function",
                    "function": {"name": name, "arguments": ""},
                }
            ]
        }

    def _arguments(self, index: int, arguments: str) -> list[dict[str, Any]]:
        call = self.calls[index]
        if len(arguments) <= len(call.arguments):
            return []
        if not arguments.startswith(call.arguments):
            log.warning("tool call %d's arguments do not continue what was streamed", index)
            return []
        piece, call.arguments = arguments[len(call.arguments) :], arguments
        return [{"tool_calls": [{"index": index, "function": {"arguments": piece}}]}]
