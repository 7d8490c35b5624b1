"""The token ids a request's prompt becomes at the node, for routing: the node's own
tokenizer, chat template and rules (``pagedllm.api.tokenizing``), off the event loop."""

from __future__ import annotations

from pagedllm.api.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.api.tokenizing import TokenizingContext, prompt_items

# A longer prompt text is routed by its start alone, so that one huge prompt costs the router
# little: its first ROUTE_TEXT_CHARS characters are tokenized and the last TRIM_TOKENS tokens
# dropped (the cut can split what the whole text tokenizes as one token).
ROUTE_TEXT_CHARS = 1 << 18
TRIM_TOKENS = 64


async def routing_tokens(
    ctx: TokenizingContext, body: CompletionRequest | ChatCompletionRequest
) -> list[int]:
    """The first prompt's leading token ids (a request with several prompts goes where its
    first is cached)."""
    if isinstance(body, ChatCompletionRequest):
        text = await ctx.render_request(body)
        return await _tokens(ctx, text, chat=True)
    items = prompt_items(body)
    if not items:
        return []
    first = items[0]
    if isinstance(first, list):
        return first
    ctx.check_prompt_bytes(first)
    return await _tokens(ctx, first, chat=False)


async def _tokens(ctx: TokenizingContext, text: str, chat: bool) -> list[int]:
    cut = len(text) > ROUTE_TEXT_CHARS
    head = text[:ROUTE_TEXT_CHARS] if cut else text
    ids = await (ctx.chat_tokens(head) if chat else ctx.encode(head))
    return ids[:-TRIM_TOKENS] if cut else ids
