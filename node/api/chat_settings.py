"""The server-wide chat settings: the chat template and the tool-call flags."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass


@dataclass
class ChatSettings:
    # A template's text, in place of the model's (--chat-template).
    chat_template: str | None = None
    # "auto" tool choice parses calls out of free text (--enable-auto-tool-choice) with this
    # parser (--tool-call-parser).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None


def read_chat_template(value: str) -> str:
    """--chat-template's value as a template's text: a file's content, or the value itself
    when it is a Jinja template (ValueError: neither). The API server and the router read it
    alike, so that both render a chat to the same text."""
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as file:
                return file.read()
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"cannot read {value}: {error}") from None
    if not any(mark in value for mark in ("{{", "{%")):
        raise ValueError(f"{value}: neither a file nor a Jinja template")
    return value


def chat_template_arg(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> str | None:
    """--chat-template's text (``serve`` and ``router`` take it alike), None when not given."""
    if ns.chat_template is None:
        return None
    try:
        return read_chat_template(ns.chat_template)
    except ValueError as error:
        parser.error(f"--chat-template {error}")
