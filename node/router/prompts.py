"""The token ids a request's prompt becomes at the node, for routing: the node's own
tokenizer, chat template and rules (``pagedllm.api.tokenizing``).

A long prompt is first routed by its head, the tokens of its first ``HEAD_CHARS`` characters:
unless some node holds every block of the head, the rest cannot change where it goes, and
tokenizing all of a long prompt cached nowhere was most of the router's time on it (1,088
tokens: about 1.7 ms, the head 0.3 ms). Where a node does hold the whole head, the whole
prompt is tokenized before choosing.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.api.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.api.tokenizing import INLINE_TEXT_CHARS, TokenizingContext, prompt_items

# The head: short enough to be tokenized on the event loop.
HEAD_CHARS = INLINE_TEXT_CHARS
# A huge prompt is routed by its first ROUTE_TEXT_CHARS characters at most, so that one costs
# the router little.
ROUTE_TEXT_CHARS = 1 << 18
# Tokens dropped from the end of a cut text: the cut can split what the whole text tokenizes
# as one token (and, in some tokenizers, change a few tokens before it).
TRIM_TOKENS = 64


@dataclass(frozen=True)
class RoutingPrompt:
    """A request's first prompt (a request with several goes where its first is cached):
    ``head``, its leading token ids, all of them unless ``rest`` holds the text to tokenize
    for the whole."""

    head: list[int]
    rest: tuple[str, bool] | None = None  # (text, chat)

    async def whole(self, ctx: TokenizingContext) -> list[int]:
        if self.rest is None:
            return self.head
        text, chat = self.rest
        return await _tokens(ctx, text, chat, ROUTE_TEXT_CHARS)


async def routing_prompt(
    ctx: TokenizingContext, body: CompletionRequest | ChatCompletionRequest
) -> RoutingPrompt:
    if isinstance(body, ChatCompletionRequest):
        text, chat = await ctx.render_request(body), True
    else:
        items = prompt_items(body)
        if not items:
            return RoutingPrompt([])
        first = items[0]
        if isinstance(first, list):
            return RoutingPrompt(first)
        ctx.check_prompt_bytes(first)
        text, chat = first, False
    head = await _tokens(ctx, text, chat, HEAD_CHARS)
    return RoutingPrompt(head, None if len(text) <= HEAD_CHARS else (text, chat))


async def routing_tokens(
    ctx: TokenizingContext, body: CompletionRequest | ChatCompletionRequest
) -> list[int]:
    """The first prompt's leading token ids, as many as routing ever looks at."""
    return await (await routing_prompt(ctx, body)).whole(ctx)


async def _tokens(ctx: TokenizingContext, text: str, chat: bool, limit: int) -> list[int]:
    cut = len(text) > limit
    head = text[:limit] if cut else text
    ids = await (ctx.chat_tokens(head) if chat else ctx.encode(head))
    return ids[:-TRIM_TOKENS] if cut else ids
