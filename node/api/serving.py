"""What the OpenAI endpoints share: errors, the serving context, sampling settings, and one
request's run from the first step to the last SSE chunk."""

from __future__ import annotations

import abc
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pagedllm.api.engine_client import EngineClient, NodeState
from pagedllm.api.errors import ApiError, unavailable
from pagedllm.api.generation import Generation, GenerationError, Step, TokenizedPrompt
from pagedllm.api.limits import (
    RequestLimits,
    prompts_refusal,
    samples_refusal,
    tokens_refusal,
)
from pagedllm.api.output_constraints import ConstraintError, output_constraint
from pagedllm.api.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.api.tokenizing import TokenizingContext, encode_text
from pagedllm.output.bad_words import bad_words_token_ids
from pagedllm.output.processor import TextDelta
from pagedllm.outputs import CompletionOutput
from pagedllm.runtime.metrics import RequestRecorder
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

# Re-exported: the API server's modules and tests import them from here.
__all__ = ["ApiError", "ServingContext", "encode_text"]

# JSON has no -inf; OpenAI clients expect a number (vLLM's choice).
MIN_LOGPROB = -9999.0


def from_generation_error(error: GenerationError) -> ApiError:
    if error.status == 503:
        return unavailable(error.message, error.code)
    kind = "invalid_request_error" if error.status < 500 else "server_error"
    return ApiError(error.status, error.message, kind, error.code)


@dataclass(kw_only=True)
class ServingContext(TokenizingContext):
    """What a request needs in the API server: the tokenizing side, the engine, the limits."""

    client: EngineClient
    metrics: RequestRecorder
    limits: RequestLimits = field(default_factory=RequestLimits)
    # --allow-runtime-lora-updating: the adapter load and unload endpoints.
    runtime_lora_updates: bool = False

    def check_admitting(self) -> None:
        state = self.client.state
        if state == NodeState.READY:
            return
        reason = {
            NodeState.STARTING: "the server is starting",
            NodeState.DRAINING: "the server is shutting down",
            NodeState.FAILED: f"the serving node failed ({self.client.failure})",
        }[state]
        raise unavailable(f"{reason}; retry the request", state.value)

    def check_prompt_count(self, prompts: int) -> None:
        refusal = prompts_refusal(self.limits, prompts)
        if refusal is not None:
            raise ApiError(400, refusal, code="too_many_prompts", param="prompt")

    def check_samples(self, n: int, best_of: int | None) -> None:
        refusal = samples_refusal(self.limits, n, best_of)
        if refusal is not None:
            message, param = refusal
            raise ApiError(400, message, code="too_many_samples", param=param)

    def check_request_tokens(self, prompts: list[TokenizedPrompt], params: SamplingParams) -> None:
        budget = [params.max_tokens or self.max_model_len - len(p.token_ids) for p in prompts]
        refusal = tokens_refusal(self.limits, params.best_of or params.n, budget)
        if refusal is not None:
            raise ApiError(400, refusal, code="request_too_large", param="max_tokens")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def clamp_logprob(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def sampling_params(
    ctx: ServingContext,
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    tool_constraint: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The request's sampling settings; ``tool_constraint`` is the grammar a forced tool call
    follows, which excludes any other output constraint."""
    unsupported = body.unsupported_fields()
    if unsupported:
        raise ApiError(
            400, f"{', '.join(unsupported)} is not supported by this server", param=unsupported[0]
        )
    if body.stream and body.best_of is not None and body.best_of != body.n:
        raise ApiError(400, "best_of must equal n when streaming", param="best_of")
    try:
        constraint = output_constraint(body)
    except ConstraintError as error:
        raise ApiError(400, str(error), param=error.param) from None
    if tool_constraint is not None:
        if constraint is not None:
            raise ApiError(
                400,
                "a forced tool call (tool_choice required or named) cannot also follow "
                "response_format or structured_outputs",
                param="tool_choice",
            )
        constraint = tool_constraint
    logit_bias = _logit_bias(body.logit_bias)
    ctx.check_token_ids(list(logit_bias or {}), "logit_bias")
    ctx.check_token_ids(body.allowed_token_ids or [], "allowed_token_ids")
    try:
        return SamplingParams(
            n=body.n,
            best_of=body.best_of,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=body.repetition_penalty or 1.0,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            min_p=body.min_p or 0.0,
            seed=body.seed,
            stop=body.stop,
            stop_token_ids=list(body.stop_token_ids or []),
            include_stop_str_in_output=body.include_stop_str_in_output,
            ignore_eos=body.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens,
            structured_outputs=constraint,
            logit_bias=logit_bias,
            allowed_token_ids=body.allowed_token_ids,
            bad_words=body.bad_words,
            bad_words_token_ids=(
                bad_words_token_ids(ctx.tokenizer, body.bad_words) if body.bad_words else None
            ),
        )
    except ValueError as error:
        # SamplingParams names the offending field first ("top_p must be in (0, 1], got 0").
        raise ApiError(400, str(error), param=str(error).split(" ", 1)[0]) from None


def _logit_bias(given: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias: token ids (as JSON keys, so text) to biases in [-100, 100]."""
    if not given:
        return None
    bias = {}
    for key, value in given.items():
        if not key.strip().isdigit() or not -100.0 <= value <= 100.0:
            raise ApiError(
                400,
                f"logit_bias maps token ids to values in [-100, 100], got {key!r}: {value}",
                param="logit_bias",
            )
        bias[int(key)] = value
    return bias


def check_lengths(
    ctx: ServingContext, prompts: list[TokenizedPrompt], max_tokens: int | None
) -> None:
    for prompt in prompts:
        n = len(prompt.token_ids)
        if n >= ctx.max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {ctx.max_model_len} tokens, but the "
                f"prompt has {n} tokens, which leaves no room for a completion",
                code="context_length_exceeded",
                param="prompt",
            )
        if max_tokens is not None and n + max_tokens > ctx.max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {ctx.max_model_len} tokens. However, "
                f"you requested {n + max_tokens} tokens ({n} in the prompt, {max_tokens} in the "
                "completion). Reduce the length of the prompt or the completion.",
                code="context_length_exceeded",
                param="max_tokens",
            )


@dataclass
class GenerationRun(abc.ABC):
    """One completions or chat request: its whole response at the end, or its SSE stream.

    A request with several prompts (completions) numbers its choices prompt by prompt:
    ``prompt_index * n + sequence index``.
    """

    ctx: ServingContext
    body: CompletionRequest | ChatCompletionRequest
    generation: Generation
    response_id: str
    created: int

    # The ``object`` of each streamed chunk.
    CHUNK_OBJECT: ClassVar[str]

    @abc.abstractmethod
    def response(self) -> dict[str, Any]:
        """The whole answer, once the generation is done."""

    @abc.abstractmethod
    def stream_choices(
        self, prompt_index: int, index: int, delta: TextDelta, first: bool
    ) -> list[dict[str, Any]]:
        """The choices one step of choice ``index`` streams, each in a chunk of its own
        (none when it adds nothing); ``first`` for the choice's first step."""

    @abc.abstractmethod
    def final_choice(self, index: int, output: CompletionOutput) -> dict[str, Any]:
        """The closing choice of one that ended without saying why in its last step."""

    def final_choices(self, index: int, output: CompletionOutput) -> list[dict[str, Any]]:
        """The closing choices (each in a chunk of its own) of such a choice."""
        return [self.final_choice(index, output)]

    @property
    def model_name(self) -> str:
        """The model the response names: the adapter asked for, or the served model."""
        lora = self.generation.lora
        return self.ctx.model_name if lora is None else lora.lora_name

    def usage(self) -> dict[str, int]:
        prompt = sum(len(p.token_ids) for p in self.generation.prompts)
        completion = sum(len(o.token_ids) for out in self.generation.outputs() for o in out.outputs)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def chunk(
        self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None
    ) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": self.CHUNK_OBJECT,
            "created": self.created,
            "model": self.model_name,
            "choices": choices,
            "usage": usage,
        }

    async def stream(self, first: Step) -> AsyncIterator[bytes]:
        """SSE from the first step on: each step's choices, a closing chunk for every choice
        whose end was not streamed, the usage if asked for, then [DONE]; an error that
        arrives mid-stream is its last event."""
        n = self.body.n
        started: set[int] = set()
        finished: set[int] = set()
        event: Step | None = first
        try:
            while event is not None:
                prompt_index, deltas = event
                for d in deltas:
                    index = prompt_index * n + d.index
                    for choice in self.stream_choices(prompt_index, index, d, index not in started):
                        yield sse(self.chunk([choice]))
                    started.add(index)
                    if d.finish_reason is not None:
                        finished.add(index)
                event = await self.generation.next()
            for chunk in self._closing_chunks(finished):
                yield chunk
        except GenerationError as error:
            yield sse(from_generation_error(error).body())
        yield SSE_DONE

    def _closing_chunks(self, finished: set[int]) -> Iterator[bytes]:
        n = self.body.n
        for prompt_index, out in enumerate(self.generation.outputs()):
            for o in out.outputs:
                index = prompt_index * n + o.index
                if index not in finished:
                    for choice in self.final_choices(index, o):
                        yield sse(self.chunk([choice]))
        if self.body.stream_options and self.body.stream_options.include_usage:
            yield sse(self.chunk([], usage=self.usage()))
