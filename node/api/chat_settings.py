"""The server-wide chat settings: the chat template and the tool-call flags."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ChatSettings:
    # A template's text, in place of the model's (--chat-template).
    chat_template: str | None = None
    # "auto" tool choice parses calls out of free text (--enable-auto-tool-choice) with this
    # parser (--tool-call-parser).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
