"""Prompt text to token ids as a node sees it: the model's tokenizer and chat template, run off
the event loop, and the checks that need only the tokenizer and the model's sizes.

Shared by the API server (``ServingContext`` builds on it) and the router, which must tokenize
a request exactly as the node it forwards to will.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from pagedllm.api.chat_settings import ChatSettings
from pagedllm.api.chat_template import (
    ChatRendering,
    accepted_template_kwargs,
    chat_rendering,
    chat_template,
    template_message,
)
from pagedllm.api.errors import ApiError
from pagedllm.api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    TokenizeChatRequest,
)
from pagedllm.core.lora_request import LoRARequest

# Threads that tokenize and render chat templates, off the event loop (the tokenizers library
# releases the GIL while it encodes). Large texts get half the CPUs, so that tokenizing them
# leaves the workers room to compute; texts up to SMALL_TEXT_CHARS have threads of their own,
# so that a small request never waits behind large prompts.
LARGE_TEXT_THREADS = max(1, len(os.sched_getaffinity(0)) // 2)
SMALL_TEXT_THREADS = 4
SMALL_TEXT_CHARS = 65536
# Texts up to this many characters (a few hundred tokens, well under a millisecond) are
# encoded on the loop itself: handing one to a thread and back costs more (about 0.2 ms
# here), time added to every short request's first token.
INLINE_TEXT_CHARS = 2048

T = TypeVar("T")


@dataclass(kw_only=True)
class TokenizingContext:
    tokenizer: Any
    model_names: list[str]
    model_dir: str
    # LoRA adapters a request may name as its model (--lora-modules), by name.
    adapters: dict[str, LoRARequest] = field(default_factory=dict)
    max_model_len: int
    vocab_size: int
    # The longest token's byte length (token_bytes.max_token_bytes); None: no sound bound.
    max_token_bytes: int | None = None
    # --chat-template and the tool-call flags: the API server and the router take the same
    # ones, so that both render a chat to the same text.
    chat: ChatSettings = field(default_factory=ChatSettings)
    _large: anyio.CapacityLimiter = field(
        default_factory=lambda: anyio.CapacityLimiter(LARGE_TEXT_THREADS), init=False
    )
    _small: anyio.CapacityLimiter = field(
        default_factory=lambda: anyio.CapacityLimiter(SMALL_TEXT_THREADS), init=False
    )

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, name: str | None) -> LoRARequest | None:
        """The adapter ``name`` means (None: the base model), or a 404 naming what is served."""
        if name is None or name in self.model_names:
            return None
        adapter = self.adapters.get(name)
        if adapter is None:
            raise ApiError(
                404,
                f"The model `{name}` does not exist; this server serves "
                f"{', '.join([*self.model_names, *self.adapters])}",
                "not_found_error",
                "model_not_found",
                "model",
            )
        return adapter

    def check_token_ids(self, ids: list[int], param: str) -> None:
        bad = [t for t in ids if t >= self.vocab_size]
        if bad:
            raise ApiError(
                400,
                f"{param} contains token ids outside the vocabulary "
                f"[0, {self.vocab_size}): {bad[:5]}",
                param=param,
            )

    async def in_thread(self, size: int, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` on one of the tokenizer threads, so the loop keeps answering;
        ``size``: how many characters it works on."""
        limiter = self._small if size <= SMALL_TEXT_CHARS else self._large
        return await anyio.to_thread.run_sync(function, *args, limiter=limiter)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) <= INLINE_TEXT_CHARS:
            return encode_text(self.tokenizer, text, add_special_tokens)
        encode = functools.partial(
            encode_text, self.tokenizer, add_special_tokens=add_special_tokens
        )
        return await self.in_thread(len(text), encode, text)

    async def render_request(self, body: ChatCompletionRequest | TokenizeChatRequest) -> str:
        """A chat request's messages as the model's prompt text, rendered as the request asks
        (tools, generation prompt, continued final message, template variables)."""
        try:
            options = chat_rendering(body)
        except ValueError as error:
            raise ApiError(400, str(error), param="chat_template_kwargs") from None
        return await self.render_chat(body.messages, options)

    async def render_chat(
        self, messages: list[ChatMessage], options: ChatRendering | None = None
    ) -> str:
        options = options or ChatRendering()
        template = chat_template(self.tokenizer, self.chat, options.uses_tools(messages))
        if template is None:
            raise ApiError(
                400, "this model has no chat template; use /v1/completions", param="messages"
            )
        conversation = [template_message(m) for m in messages]
        render = functools.partial(
            self.tokenizer.apply_chat_template,
            tools=options.tools,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            **accepted_template_kwargs(options.template_kwargs, self.tokenizer, template),
        )
        try:
            size = sum(len(str(m.get("content") or "")) for m in conversation)
            text: str = await self.in_thread(size, render, conversation)
        except Exception as error:  # the template's own raise_exception and jinja errors
            raise ApiError(
                400, f"the chat template rejected the messages: {error}", param="messages"
            ) from None
        return text

    async def chat_tokens(self, text: str) -> list[int]:
        """The token ids of a rendered chat: the template already wrote the special tokens."""
        return await self.encode(text, add_special_tokens=False)

    def check_prompt_bytes(self, text: str) -> None:
        """Refuse, before tokenizing, a prompt too long in bytes to fit: each token covers at
        most ``max_token_bytes`` bytes, so it has at least bytes / that many tokens. (Whether
        the completion fits too is checked once the exact count is known.)"""
        if self.max_token_bytes is None:
            return
        size = len(text.encode("utf-8"))
        least = -(-size // self.max_token_bytes)
        if least >= self.max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens, but the "
                f"prompt has at least {least} tokens (its {size} bytes of text), which leaves "
                "no room for a completion",
                code="context_length_exceeded",
                param="prompt",
            )


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """``tokenizer.encode``, through the Rust tokenizer where there is one: its batch call
    releases the GIL while it encodes, and the fast variant skips the offsets that transformers
    would compute and convert (which hold the GIL for a long while on a large prompt)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        ids: list[int] = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return ids
    return backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids


def prompt_items(body: CompletionRequest) -> list[str | list[int]]:
    """A completions request's prompts, one item each: a text or a list of token ids."""
    raw = body.prompt
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        return [raw]  # type: ignore[list-item]
    return list(raw)  # type: ignore[arg-type]
