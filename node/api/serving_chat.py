"""POST /v1/chat/completions: messages through the chat template, JSON or SSE out."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.api.generation import Generation, TokenizedPrompt
from pagedllm.api.protocol import ChatCompletionRequest
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
from pagedllm.api.tool_call_stream import ToolCallStream
from pagedllm.api.tool_calls import (
    ToolChoiceError,
    ToolPlan,
    plan_tools,
    tool_calls_json,
)
from pagedllm.output.processor import TextDelta
from pagedllm.outputs import CompletionOutput


@dataclass
class ChatRun(GenerationRun):
    body: ChatCompletionRequest
    tools: ToolPlan | None = None
    # With tools, each streamed choice's calls as far as they are sent.
    _streams: dict[int, ToolCallStream] = field(default_factory=dict, init=False)

    CHUNK_OBJECT = "chat.completion.chunk"

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message for ``text`` (its calls read out when tools are in play) and
        the finish reason (``tool_calls`` when it ended on them)."""
        if self.tools is None:
            return {"role": "assistant", "content": text}, finish_reason
        parsed = self.tools.read(text)
        if not parsed.calls:
            return {"role": "assistant", "content": text}, finish_reason
        message = {
            "role": "assistant",
            "content": parsed.content,
            "tool_calls": tool_calls_json(parsed.calls),
        }
        return message, "tool_calls" if finish_reason == "stop" else finish_reason

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

    def response(self) -> dict[str, Any]:
        choices = []
        for o in self.generation.outputs()[0].outputs:
            logprobs = None
            if self.body.logprobs:
                logprobs = self.logprobs(list(o.token_ids), list(o.logprobs or []))
            message, finish_reason = self.message(o.text, o.finish_reason)
            choices.append(
                {
                    "index": o.index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                    "stop_reason": o.stop_reason,
                }
            )
        return {
            "id": self.response_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model_name,
            "choices": choices,
            "usage": self.usage(),
        }

    def stream_choices(
        self, prompt_index: int, index: int, delta: TextDelta, first: bool
    ) -> list[dict[str, Any]]:
        choices = []
        if first:  # the role, alone, opens each choice
            choices.append(
                {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            )
        if self.tools is not None:
            stream = self._streams.setdefault(index, ToolCallStream(self.tools))
            choices += [self._delta_choice(index, d) for d in stream.feed(delta.text)]
            if delta.finish_reason is not None:
                choices += self._closing(index, delta.finish_reason, delta.stop_reason)
            return choices
        logprobs = None
        if self.body.logprobs and delta.logprobs:
            logprobs = self.logprobs(delta.token_ids, list(delta.logprobs))
        if delta.text or delta.finish_reason is not None or logprobs is not None:
            choices.append(
                {
                    "index": index,
                    "delta": {"content": delta.text} if delta.text else {},
                    "logprobs": logprobs,
                    "finish_reason": delta.finish_reason,
                    "stop_reason": delta.stop_reason,
                }
            )
        return choices

    @staticmethod
    def _delta_choice(index: int, delta: dict[str, Any]) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}

    def _closing(
        self, index: int, finish_reason: str | None, stop_reason: int | str | None
    ) -> list[dict[str, Any]]:
        """A tool-aware choice's last deltas and its finish."""
        assert self.tools is not None
        stream = self._streams.pop(index, None) or ToolCallStream(self.tools)
        deltas, finish_reason = stream.finish(finish_reason)
        return [self._delta_choice(index, d) for d in deltas] + [
            {
                "index": index,
                "delta": {},
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        ]

    def final_choice(self, index: int, output: CompletionOutput) -> dict[str, Any]:
        return {
            "index": index,
            "delta": {},
            "logprobs": None,
            "finish_reason": output.finish_reason,
            "stop_reason": output.stop_reason,
        }

    def final_choices(self, index: int, output: CompletionOutput) -> list[dict[str, Any]]:
        if self.tools is not None:
            return self._closing(index, output.finish_reason, output.stop_reason)
        return [self.final_choice(index, output)]


async def prepare_chat(ctx: ServingContext, body: ChatCompletionRequest) -> ChatRun:
    lora = ctx.check_model(body.model)
    ctx.check_samples(body.n, body.best_of)
    max_tokens = body.max_completion_tokens or body.max_tokens
    try:
        tools = plan_tools(body, ctx.chat)
        tool_constraint = None if tools is None else tools.constraint()
    except (ToolChoiceError, ValueError) as error:
        raise ApiError(400, str(error), param="tool_choice") from None
    text = await ctx.render_request(body)
    ctx.check_prompt_bytes(text)
    prompt = TokenizedPrompt(text, await ctx.chat_tokens(text))
    check_lengths(ctx, [prompt], max_tokens)
    top = body.top_logprobs
    if top is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    params = sampling_params(
        ctx, body, max_tokens, (top or 0) if body.logprobs else None, None, tool_constraint
    )
    ctx.check_request_tokens([prompt], params)
    ctx.check_token_ids(params.stop_token_ids or [], "stop_token_ids")
    ctx.check_admitting()
    response_id = random_id("chatcmpl")
    generation = Generation(
        ctx.client,
        ctx.metrics,
        ctx.tokenizer,
        response_id,
        [prompt],
        params,
        streaming=body.stream,
        lora=lora,
    )
    return ChatRun(ctx, body, generation, response_id, int(time.time()), tools)
