"""Messages through a chat template: which template, and the messages as templates read them.

The template is ``--chat-template`` when given, else the model's; a conversation with tools
on a model whose template knows none gets the built-in Hermes-style tool template, so that a
tool conversation always renders (and the hermes parser reads its calls back).
"""

from __future__ import annotations

import functools
import inspect
import json
import re
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import jinja2
import jinja2.meta
import jinja2.sandbox

from pagedllm.api.chat_settings import ChatSettings
from pagedllm.api.protocol import ChatCompletionRequest, ChatMessage, ChatTool, TokenizeChatRequest

# chat_template_kwargs follows vLLM's rule. These two keys are refused (400): they would bypass
# the server's choice of template and its rendering to text.
REFUSED_KWARGS = ("chat_template", "tokenize")
# Keys the server sets itself, dropped from chat_template_kwargs: the request's top-level
# add_generation_prompt and continue_final_message win (their defaults included), the tools are
# the request's, and the others would change what the template call returns.
SERVER_KWARGS = frozenset(
    {
        "conversation",
        "tools",
        "add_generation_prompt",
        "continue_final_message",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
    }
)
# transformers' own tag for assistant masks, unknown to plain jinja2 (it marks, renders nothing).
GENERATION_TAG = re.compile(r"{%-?\s*(end)?generation\s*-?%}")


@dataclass
class ChatRendering:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    # chat_template_kwargs: extra variables for the template (e.g. enable_thinking).
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        refused = [key for key in REFUSED_KWARGS if key in self.template_kwargs]
        if refused:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(refused)}")

    def uses_tools(self, messages: list[ChatMessage]) -> bool:
        return bool(self.tools) or any(m.tool_calls or m.role == "tool" for m in messages)


def chat_rendering(body: ChatCompletionRequest | TokenizeChatRequest) -> ChatRendering:
    """How a chat request asks its messages to be rendered (ValueError: chat_template_kwargs
    sets chat_template or tokenize)."""
    return ChatRendering(
        body.add_generation_prompt,
        body.continue_final_message,
        template_tools(body.tools),
        dict(body.chat_template_kwargs or {}),
    )


def accepted_template_kwargs(
    kwargs: dict[str, Any], tokenizer: Any, template: str
) -> dict[str, Any]:
    """vLLM's rule: of a request's chat_template_kwargs, the keys that the tokenizer's
    ``apply_chat_template`` takes by name (``documents``, ...) or that the template reads
    (``enable_thinking``, ...), less those the server sets; the others are dropped."""
    if not kwargs:
        return {}
    accepted = (call_parameters(type(tokenizer)) | template_variables(template)) - SERVER_KWARGS
    return {key: value for key, value in kwargs.items() if key in accepted}


@functools.cache
def call_parameters(tokenizer_class: type) -> frozenset[str]:
    """The named parameters of ``apply_chat_template`` (not its ``**kwargs``)."""
    parameters = inspect.signature(tokenizer_class.apply_chat_template).parameters.values()
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(p.name for p in parameters if p.kind in named and p.name != "self")


@functools.lru_cache(maxsize=32)
def template_variables(template: str) -> frozenset[str]:
    """The variables a template reads from outside (none if it does not parse here)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        parsed = env.parse(GENERATION_TAG.sub("", template))
    except jinja2.TemplateSyntaxError:
        return frozenset()
    return frozenset(jinja2.meta.find_undeclared_variables(parsed))


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
