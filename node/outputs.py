"""What the offline API returns, shaped like vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.core.request_delta import RequestTimings


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestTimings
    error: str | None = None


@dataclass
class BeamSearchSequence:
    tokens: list[int]
    text: str
    cum_logprob: float


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence] = field(default_factory=list)
