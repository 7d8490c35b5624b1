"""What the scheduler reports about a request after a step: new tokens and finishes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SeqDelta:
    index: int
    new_token_ids: list[int]
    # For each new token, {token: logprob} (sampled token first) when logprobs were asked for.
    new_logprobs: list[dict[int, float]] | None
    cumulative_logprob: float
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestTimings:
    arrival: float
    queued: float  # seconds waiting before first scheduled
    first_token: float | None  # seconds from arrival to first token
    finished: float | None  # seconds from arrival to finish


@dataclass
class RequestDelta:
    request_id: str
    seqs: list[SeqDelta] = field(default_factory=list)
    # Log probabilities of every prompt token (None for the first), sent once.
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    finished: bool = False
    # With best_of > n or beam search, the indices of the sequences to return, best first.
    final_order: list[int] | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    timings: RequestTimings | None = None
    # When several steps were merged into one delta: when each produced its tokens
    # (time.monotonic()), for inter-token latency.
    step_times: list[float] = field(default_factory=list)
