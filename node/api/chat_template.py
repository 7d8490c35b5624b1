"""Messages through a chat template: which template, and the messages as templates read them.

The template is ``--chat-template`` when given, else the model's; a conversation with tools
on a model whose template knows none gets the built-in Hermes-style tool template, so that a
tool conversation always renders (and the hermes parser reads its calls back).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from pagedllm.api.chat_settings import ChatSettings
from pagedllm.api.protocol import ChatCompletionRequest, ChatMessage, ChatTool

# Arguments of the template call that chat_template_kwargs may not set: the request's own
# fields set them.
RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "tools",
        "chat_template",
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "return_dict",
        "return_tensors",
    }
)


@dataclass
class ChatRendering:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    # chat_template_kwargs: extra variables for the template (e.g. enable_thinking).
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        clash = sorted(RESERVED_KWARGS & set(self.template_kwargs))
        if clash:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)}")

    def uses_tools(self, messages: list[ChatMessage]) -> bool:
        return bool(self.tools) or any(m.tool_calls or m.role == "tool" for m in messages)


def chat_rendering(body: ChatCompletionRequest) -> ChatRendering:
    """How a chat request asks its messages to be rendered (ValueError: chat_template_kwargs
    sets an argument of the template call itself)."""
    return ChatRendering(
        body.add_generation_prompt,
        body.continue_final_message,
        template_tools(body.tools),
        dict(body.chat_template_kwargs or {}),
    )


def template_tools(tools: list[ChatTool] | None) -> list[dict[str, Any]] | None:
    """The tools as chat templates take them (OpenAI's JSON form). They are in the prompt
    even with tool_choice "none", as with vLLM, so a conversation reads the same each turn."""
    if not tools:
        return None
    return [t.model_dump(exclude_none=True) for t in tools]


@functools.cache
def tool_template() -> str:
    return (resources.files("pagedllm.models") / "data" / "tool_chat_template.jinja").read_text(
        encoding="utf-8"
    )


def chat_template(tokenizer: Any, settings: ChatSettings, uses_tools: bool) -> str | None:
    if settings.chat_template is not None:
        return settings.chat_template
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # named templates: the default one
        own = own.get("default")
    if uses_tools and (not own or "tool" not in own):
        return tool_template()
    return own if isinstance(own, str) and own else None


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as Hugging Face chat templates take it: text content, and each tool call's
    arguments as an object where they are one (Llama's and others' templates write them with
    ``tojson``)."""
    out: dict[str, Any] = {"role": message.role, "content": _text(message)}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments(call.function.arguments),
                },
            }
            for call in message.tool_calls
        ]
    return out


def _text(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "\n".join(part.text for part in message.content)


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text
