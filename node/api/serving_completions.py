"""POST /v1/completions: text or token-id prompts (one or several), JSON or SSE out."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.api.generation import Generation, TokenizedPrompt
from pagedllm.api.protocol import CompletionRequest
from pagedllm.api.serving import (
    MIN_LOGPROB,
    ApiError,
    GenerationRun,
    ServingContext,
    check_lengths,
    clamp_logprob,
    random_id,
    sampling_params,
)
from pagedllm.api.tokenizing import prompt_items
from pagedllm.output.processor import TextDelta
from pagedllm.outputs import CompletionOutput


async def completion_prompts(ctx: ServingContext, body: CompletionRequest) -> list[TokenizedPrompt]:
    """The prompts, tokenized off the event loop once their number and sizes are known to fit."""
    items = prompt_items(body)
    if not items:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    ctx.check_prompt_count(len(items))
    for item in items:
        if isinstance(item, str):
            ctx.check_prompt_bytes(item)
    prompts = []
    for item in items:
        if isinstance(item, str):
            prompts.append(TokenizedPrompt(item, await ctx.encode(item)))
        else:
            if not item:
                raise ApiError(400, "a token-id prompt must not be empty", param="prompt")
            ctx.check_token_ids(item, "prompt")
            prompts.append(TokenizedPrompt(None, list(item)))
    return prompts


@dataclass
class CompletionRun(GenerationRun):
    body: CompletionRequest
    # Text offset of each streamed choice's next token (for logprobs.text_offset).
    _offsets: dict[int, int] = field(default_factory=dict, init=False)

    CHUNK_OBJECT = "text_completion"

    def prompt_text(self, index: int) -> str:
        prompt = self.generation.prompts[index]
        if prompt.text is None:
            prompt.text = self.ctx.tokenizer.decode(prompt.token_ids)
        return prompt.text

    def logprobs(
        self, token_ids: list[int], entries: list[dict[int, float] | None], offset: int
    ) -> dict[str, Any]:
        decode = self.ctx.tokenizer.decode
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token, entry in zip(token_ids, entries, strict=True):
            text = decode([token])
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if entry is None:  # the first prompt token has no logprob
                token_logprobs.append(None)
                tops.append(None)
                continue
            token_logprobs.append(clamp_logprob(entry.get(token, MIN_LOGPROB)))
            tops.append({decode([t]): clamp_logprob(lp) for t, lp in entry.items()})
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def response(self) -> dict[str, Any]:
        choices = []
        n = self.body.n
        for i, out in enumerate(self.generation.outputs()):
            for o in out.outputs:
                choices.append(self._choice(i * n + o.index, i, o, out.prompt_logprobs))
        return {
            "id": self.response_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model_name,
            "choices": choices,
            "usage": self.usage(),
        }

    def _choice(
        self,
        index: int,
        prompt_index: int,
        o: CompletionOutput,
        prompt_logprobs: list[dict[int, float] | None] | None,
    ) -> dict[str, Any]:
        text, logprobs = o.text, None
        prefix = self.prompt_text(prompt_index) if self.body.echo else ""
        if self.body.logprobs is not None:
            ids, entries = self._with_prompt(
                prompt_index, list(o.token_ids), list(o.logprobs or []), prompt_logprobs
            )
            logprobs = self.logprobs(ids, entries, 0)
        return {
            "index": index,
            "text": prefix + text,
            "logprobs": logprobs,
            "finish_reason": o.finish_reason,
            "stop_reason": o.stop_reason,
        }

    def _with_prompt(
        self,
        prompt_index: int,
        ids: list[int],
        entries: list[dict[int, float] | None],
        prompt_logprobs: list[dict[int, float] | None] | None,
    ) -> tuple[list[int], list[dict[int, float] | None]]:
        """With echo, the prompt's tokens (the first without a logprob) lead the output's."""
        if not self.body.echo:
            return ids, entries
        prompt_ids = self.generation.prompts[prompt_index].token_ids
        prompt_entries = list(prompt_logprobs or [None] * len(prompt_ids))
        return prompt_ids + ids, prompt_entries + entries

    def stream_choices(
        self, prompt_index: int, index: int, delta: TextDelta, first: bool
    ) -> list[dict[str, Any]]:
        text, ids, entries = delta.text, delta.token_ids, list(delta.logprobs or [])
        if first and self.body.echo:
            text = self.prompt_text(prompt_index) + text
            state = self.generation.requests[prompt_index].state
            ids, entries = self._with_prompt(prompt_index, ids, entries, state.prompt_logprobs)
        logprobs = None
        if self.body.logprobs is not None and entries:
            offset = self._offsets.get(index, 0)
            logprobs = self.logprobs(ids, entries, offset)
            self._offsets[index] = offset + sum(len(t) for t in logprobs["tokens"])
        if not text and delta.finish_reason is None and logprobs is None:
            return []
        return [
            {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": delta.finish_reason,
                "stop_reason": delta.stop_reason,
            }
        ]

    def final_choice(self, index: int, output: CompletionOutput) -> dict[str, Any]:
        return {
            "index": index,
            "text": "",
            "logprobs": None,
            "finish_reason": output.finish_reason,
            "stop_reason": output.stop_reason,
        }


async def prepare_completion(ctx: ServingContext, body: CompletionRequest) -> CompletionRun:
    lora = ctx.check_model(body.model)
    ctx.check_samples(body.n, body.best_of)
    prompts = await completion_prompts(ctx, body)
    check_lengths(ctx, prompts, body.max_tokens)
    logprobs = body.logprobs
    params = sampling_params(
        ctx,
        body,
        body.max_tokens,
        logprobs,
        logprobs if body.echo and logprobs is not None else None,
    )
    ctx.check_request_tokens(prompts, params)
    ctx.check_token_ids(params.stop_token_ids or [], "stop_token_ids")
    ctx.check_admitting()
    response_id = random_id("cmpl")
    generation = Generation(
        ctx.client,
        ctx.metrics,
        ctx.tokenizer,
        response_id,
        prompts,
        params,
        streaming=body.stream,
        lora=lora,
    )
    return CompletionRun(ctx, body, generation, response_id, int(time.time()))
