"""One HTTP request's engine requests (one per prompt), followed from start to finish.

The scheduler's messages are applied as they arrive (detokenization, stop strings, metrics),
inside the API server's receive loop; the HTTP handler is only woken when it has something to
do: every step when it streams, at the end (or on an error) when it answers once. Whatever is
unfinished when the HTTP request ends early (client gone, error) is aborted, so its KV blocks
are freed.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pagedllm.api.engine_client import EngineClient
from pagedllm.core.lora_request import LoRARequest
from pagedllm.core.request_delta import RequestDelta
from pagedllm.ipc.messages import DrainDeadline, NodeFailed, RequestRejected
from pagedllm.output.processor import RequestOutputState, TextDelta
from pagedllm.outputs import RequestOutput
from pagedllm.runtime.metrics import RequestRecorder
from pagedllm.runtime.tracing import RequestTrace
from pagedllm.sampling_params import SamplingParams

# (prompt index, what its sequences added in one step)
Step = tuple[int, list[TextDelta]]


class GenerationError(Exception):
    """The request cannot complete; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


@dataclass
class TokenizedPrompt:
    """One prompt of an HTTP request as the engine takes it; ``text`` is None for a
    token-id prompt (until echo decodes it)."""

    text: str | None
    token_ids: list[int]


@dataclass
class EngineRequest:
    request_id: str
    state: RequestOutputState
    arrival: float = 0.0
    last_token_at: float | None = None
    done: bool = False


@dataclass
class Generation:
    client: EngineClient
    metrics: RequestRecorder
    tokenizer: Any
    request_id: str
    prompts: list[TokenizedPrompt]
    params: SamplingParams
    # Whether the handler takes every step (SSE) or only the end.
    streaming: bool
    # The LoRA adapter the request's model names (None: the base model).
    lora: LoRARequest | None = None
    requests: list[EngineRequest] = field(default_factory=list)
    _steps: deque[Step] = field(default_factory=deque, init=False)
    _error: GenerationError | None = field(default=None, init=False)
    _wakeup: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _closed: bool = field(default=False, init=False)

    def start(self) -> None:
        self.client.begin()
        if self.lora is not None:
            self.metrics.lora_request(self.lora.lora_name)
        for i, prompt in enumerate(self.prompts):
            request_id = f"{self.request_id}-{i}"
            state = RequestOutputState(
                request_id,
                prompt.text,
                prompt.token_ids,
                self.params,
                self.tokenizer,
                time.monotonic(),
            )
            request = EngineRequest(request_id, state)
            self.requests.append(request)
            request.arrival = self.client.add(
                request_id,
                prompt.token_ids,
                self.params,
                lambda message, tag=i: self._receive(tag, message),
                # Stop strings are found in the text, so it must follow every step.
                final_only=not self.streaming and not self.params.stop_strings,
                first_of_request=i == 0,
                lora=self.lora,
            )

    @property
    def done(self) -> bool:
        return all(r.done for r in self.requests)

    async def next(self) -> Step | None:
        """The next step of one of the prompts (when streaming); None after the last."""
        while not self._steps:
            if self._error is not None:
                raise self._error
            if self.done:
                return None
            self._wakeup.clear()
            await self._wakeup.wait()
        return self._steps.popleft()

    async def run_to_end(self) -> None:
        while not self.done:
            if self._error is not None:
                raise self._error
            self._wakeup.clear()
            await self._wakeup.wait()
        if self._error is not None:
            raise self._error

    def outputs(self) -> list[RequestOutput]:
        return [r.state.output() for r in self.requests]

    def close(self) -> None:
        """Abort what is unfinished and stop counting this request as in flight."""
        if self._closed:
            return
        self._closed = True
        for request in self.requests:
            if not request.done:
                self.client.abort(request.request_id)
                self.metrics.finished("abort")
            else:
                self.client.forget(request.request_id)
        self.client.end()

    # ----- messages from the scheduler (called by the client's receive loop) -----------------

    def _receive(self, tag: int, message: Any) -> None:
        request = self.requests[tag]
        try:
            step = self._apply(request, message)
        except GenerationError as error:
            request.done = True
            self._error = self._error or error
            self._wakeup.set()
            return
        if self.streaming:
            self._steps.append((tag, step))
        if self.streaming or request.done:
            self._wakeup.set()

    def _apply(self, request: EngineRequest, message: Any) -> list[TextDelta]:
        if isinstance(message, RequestRejected):
            full = message.status == 503
            self.metrics.rejected_for("queue_full" if full else "invalid")
            raise GenerationError(message.status, message.message, "queue_full" if full else None)
        if isinstance(message, NodeFailed):
            raise GenerationError(
                503,
                f"the serving node failed ({message.reason}); retry the request",
                "node_failed",
            )
        if isinstance(message, DrainDeadline):
            raise GenerationError(
                503,
                f"the server shut down: its --shutdown-timeout of {message.timeout_s:g} s "
                "passed before this request finished; retry the request",
                "server_shutdown",
            )
        delta: RequestDelta = message
        if delta.error is not None:
            self.metrics.rejected_for("invalid")
            raise GenerationError(400, delta.error, "context_length_exceeded")
        deltas = request.state.apply(
            delta, functools.partial(self.client.stop_sequence, request.request_id)
        )
        self._observe(request, delta)
        if delta.finished:
            request.done = True
        return deltas

    def _observe(self, request: EngineRequest, delta: RequestDelta) -> None:
        now = time.monotonic()
        if delta.step_times and request.last_token_at is not None:
            for at in delta.step_times:  # merged steps (final_only)
                self.metrics.itl.observe(at - request.last_token_at)
                request.last_token_at = at
        elif any(s.new_token_ids for s in delta.seqs):
            if request.last_token_at is None:
                self.metrics.ttft.observe(now - request.arrival)
            else:
                self.metrics.itl.observe(now - request.last_token_at)
            request.last_token_at = now
        if delta.finished:
            self.metrics.e2e.observe(now - request.arrival)
            if delta.timings is not None:
                self.metrics.queue.observe(delta.timings.time_in_queue)
            output = request.state.output()
            reason = (output.outputs[0].finish_reason if output.outputs else None) or "abort"
            self.metrics.finished(reason)
            if self.metrics.tracer is not None and delta.timings is not None:
                self.metrics.trace(
                    RequestTrace(
                        request_id=request.request_id,
                        model=self.metrics.model,
                        timings=delta.timings,
                        prompt_tokens=len(output.prompt_token_ids or []),
                        completion_tokens=sum(len(o.token_ids) for o in output.outputs),
                        n=self.params.n,
                        max_tokens=self.params.max_tokens,
                        temperature=self.params.temperature,
                        top_p=self.params.top_p,
                        finish_reason=reason,
                    )
                )
