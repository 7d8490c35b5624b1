"""The shape of a parser for formats whose calls follow a start tag after optional text
(Hermes' ``<tool_call>``, Mistral's ``[TOOL_CALLS]``): the split into content and calls is the
same for all of them, each format supplies only how its calls are read."""

from __future__ import annotations

from abc import ABC, abstractmethod

from pagedllm.api.tool_parsers.base import (
    ParsedOutput,
    PartialCall,
    PartialOutput,
    ToolCall,
    shown_content,
)


class TaggedParser(ABC):
    """The text before the first ``start`` tag is the content and the rest holds the calls; a
    reply whose calls are not well-formed is all content (the model meant to write text)."""

    name: str
    start: str

    @abstractmethod
    def calls(self, text: str) -> list[ToolCall]:
        """The calls in ``text`` (from the start tag on); ``ValueError`` when it holds no
        well-formed call."""

    @abstractmethod
    def partial_calls(self, text: str) -> list[PartialCall]:
        """The calls begun in the start of ``text`` (from the start tag on)."""

    def parse(self, text: str) -> ParsedOutput:
        start = text.find(self.start)
        if start < 0:
            return ParsedOutput(text)
        try:
            calls = self.calls(text[start:])
        except ValueError:
            return ParsedOutput(text)
        if not calls:
            return ParsedOutput(text)
        return ParsedOutput(text[:start].strip() or None, calls)

    def parse_partial(self, text: str) -> PartialOutput:
        start = text.find(self.start)
        if start < 0:
            # An end that may be the start of the tag is held back: the next piece may complete it.
            return PartialOutput(shown_content(text, self.start))
        return PartialOutput(text[:start], self.partial_calls(text[start:]))
