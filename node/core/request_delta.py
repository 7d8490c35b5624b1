"""What the scheduler reports about a request after a step: new tokens, finishes and timings."""

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
    """When a request reached each stage, in ``time.monotonic()`` seconds (vLLM's names).

    The scheduler stamps them as the request moves; the final delta carries them, and the
    offline API returns them as ``RequestOutput.metrics``.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_in_queue(self) -> float:
        """Seconds from arrival to first scheduled (to the end, for one never scheduled)."""
        start = self.first_scheduled_time
        if start is None:
            start = self.finished_time if self.finished_time is not None else self.arrival_time
        return start - self.arrival_time


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
    # Sent with the final delta.
    timings: RequestTimings | None = None
    # When several steps were merged into one delta: when each produced its tokens
    # (time.monotonic()), for inter-token latency.
    step_times: list[float] = field(default_factory=list)
