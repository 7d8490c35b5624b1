"""POST /v1/chat/completions: messages through the chat template, JSON or SSE out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pagedllm.api.generation import Generation, GenerationError, Prompt, Step
from pagedllm.api.protocol import ChatCompletionRequest
from pagedllm.api.serving import (
    MIN_LOGPROB,
    SSE_DONE,
    ApiError,
    ServingContext,
    check_lengths,
    clamp_logprob,
    from_generation_error,
    random_id,
    sampling_params,
    sse,
)


@dataclass
class ChatRun:
    ctx: ServingContext
    body: ChatCompletionRequest
    generation: Generation
    response_id: str
    created: int

    def logprobs(self, token_ids: list[int], entries: list[dict[int, float]]) -> dict[str, Any]:
        decode = self.ctx.tokenizer.decode
        top_n = self.body.top_logprobs or 0
        content = []
        for token, entry in zip(token_ids, entries, strict=True):
            text = decode([token])
            top = sorted(entry.items(), key=lambda item: -item[1])[:top_n]
            content.append(
                {
                    "token": text,
                    "logprob": clamp_logprob(entry.get(token, MIN_LOGPROB)),
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {
                            "token": (t := decode([tid])),
                            "logprob": clamp_logprob(lp),
                            "bytes": list(t.encode()),
                        }
                        for tid, lp in top
                    ],
                }
            )
        return {"content": content}

    def usage(self) -> dict[str, int]:
        prompt = len(self.generation.prompts[0].token_ids)
        completion = sum(len(o.token_ids) for o in self.generation.outputs()[0].outputs)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def response(self) -> dict[str, Any]:
        choices = []
        for o in self.generation.outputs()[0].outputs:
            logprobs = None
            if self.body.logprobs:
                logprobs = self.logprobs(list(o.token_ids), list(o.logprobs or []))
            choices.append(
                {
                    "index": o.index,
                    "message": {"role": "assistant", "content": o.text},
                    "logprobs": logprobs,
                    "finish_reason": o.finish_reason,
                    "stop_reason": o.stop_reason,
                }
            )
        return {
            "id": self.response_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.ctx.model_name,
            "choices": choices,
            "usage": self.usage(),
        }

    async def stream(self, first: Step) -> AsyncIterator[bytes]:
        started: set[int] = set()
        finished: set[int] = set()
        event: Step | None = first
        try:
            while event is not None:
                for d in event[1]:
                    if d.index not in started:
                        started.add(d.index)
                        yield sse(
                            self._chunk(
                                [
                                    {
                                        "index": d.index,
                                        "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None,
                                        "finish_reason": None,
                                    }
                                ]
                            )
                        )
                    logprobs = None
                    if self.body.logprobs and d.logprobs:
                        logprobs = self.logprobs(d.token_ids, list(d.logprobs))
                    if not d.text and d.finish_reason is None and logprobs is None:
                        continue
                    if d.finish_reason is not None:
                        finished.add(d.index)
                    yield sse(
                        self._chunk(
                            [
                                {
                                    "index": d.index,
                                    "delta": {"content": d.text} if d.text else {},
                                    "logprobs": logprobs,
                                    "finish_reason": d.finish_reason,
                                    "stop_reason": d.stop_reason,
                                }
                            ]
                        )
                    )
                event = await self.generation.next()
            for o in self.generation.outputs()[0].outputs:
                if o.index not in finished:
                    yield sse(
                        self._chunk(
                            [
                                {
                                    "index": o.index,
                                    "delta": {},
                                    "logprobs": None,
                                    "finish_reason": o.finish_reason,
                                    "stop_reason": o.stop_reason,
                                }
                            ]
                        )
                    )
            if self.body.stream_options and self.body.stream_options.include_usage:
                yield sse(self._chunk([], usage=self.usage()))
        except GenerationError as error:
            yield sse(from_generation_error(error).body())
        yield SSE_DONE

    def _chunk(
        self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None
    ) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.ctx.model_name,
            "choices": choices,
            "usage": usage,
        }


def prepare_chat(ctx: ServingContext, body: ChatCompletionRequest) -> ChatRun:
    ctx.check_model(body.model)
    text = ctx.render_chat(body.messages, body.add_generation_prompt)
    prompt = Prompt(text, ctx.tokenizer.encode(text, add_special_tokens=False))
    max_tokens = body.max_completion_tokens or body.max_tokens
    check_lengths(ctx, [prompt], max_tokens)
    top = body.top_logprobs
    if top is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    params = sampling_params(body, max_tokens, (top or 0) if body.logprobs else None, None)
    ctx.check_token_ids(params.stop_token_ids or [], "stop_token_ids")
    ctx.check_admitting()
    response_id = random_id("chatcmpl")
    generation = Generation(
        ctx.client, ctx.metrics, ctx.tokenizer, response_id, [prompt], params, streaming=body.stream
    )
    return ChatRun(ctx, body, generation, response_id, int(time.time()))
