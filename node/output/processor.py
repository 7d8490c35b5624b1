"""Turns the scheduler's token deltas into text, applies stop strings, builds outputs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.request_delta import RequestDelta, RequestTimings
from pagedllm.output.detokenizer import IncrementalDetokenizer, find_stop
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams


@dataclass
class SeqState:
    detok: IncrementalDetokenizer
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Text already handed to a stream.
    emitted: int = 0


@dataclass
class TextDelta:
    """What one sequence adds in one step, for streaming."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None


# Tells the scheduler that a stop string ended sequence ``index`` (so it frees its blocks):
# (index, the stop string) -> the request's final delta when the scheduler answers at once.
StopSequence = Callable[[int, str], RequestDelta | None]


@dataclass
class RequestOutputState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    tokenizer: Any
    arrival_time: float
    seqs: dict[int, SeqState] = field(default_factory=dict)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    final_order: list[int] | None = None
    finished: bool = False
    error: str | None = None
    metrics: RequestTimings | None = None

    def _seq(self, index: int) -> SeqState:
        if index not in self.seqs:
            self.seqs[index] = SeqState(
                IncrementalDetokenizer(self.tokenizer, self.params.skip_special_tokens)
            )
        return self.seqs[index]

    def apply(self, delta: RequestDelta, stop_sequence: StopSequence) -> list[TextDelta]:
        """Apply one step, and tell the scheduler of every sequence a stop string ended."""
        deltas, stopped = self.update(delta)
        for index in stopped:
            final = stop_sequence(index, str(self.seqs[index].stop_reason))
            if final is not None:
                deltas += self.update(final)[0]
        return deltas

    def update(self, delta: RequestDelta) -> tuple[list[TextDelta], list[int]]:
        """Apply one step. Returns the stream deltas and the indices a stop string ended."""
        p = self.params
        stopped: list[int] = []
        deltas: list[TextDelta] = []
        if delta.prompt_logprobs:
            self.prompt_logprobs = delta.prompt_logprobs
        for sd in delta.seqs:
            seq = self._seq(sd.index)
            if seq.finish_reason is not None:
                continue
            before = len(seq.detok.text)
            seq.detok.add(sd.new_token_ids)
            seq.cumulative_logprob = sd.cumulative_logprob
            if sd.new_logprobs:
                seq.logprobs.extend(sd.new_logprobs)
            seq.finish_reason, seq.stop_reason = sd.finish_reason, sd.stop_reason
            hit = find_stop(seq.detok.text, before, p.stop_strings, p.include_stop_str_in_output)
            if hit is not None:
                seq.detok.text = seq.detok.text[: hit.keep]
                seq.finish_reason, seq.stop_reason = "stop", hit.stop
                stopped.append(sd.index)
            deltas.append(self._stream_delta(sd.index, seq, sd.new_token_ids, sd.new_logprobs))
        if delta.finished:
            self.finished = True
            self.final_order = delta.final_order
            self.error = delta.error
            for seq in self.seqs.values():
                seq.finish_reason = seq.finish_reason or "abort"
            if delta.timings is not None:
                self.metrics = delta.timings
        if stopped and all(s.finish_reason is not None for s in self.seqs.values()):
            self.finished = True
        return deltas, stopped

    def _stream_delta(
        self,
        index: int,
        seq: SeqState,
        token_ids: list[int],
        logprobs: list[dict[int, float]] | None,
    ) -> TextDelta:
        text = seq.detok.text
        # Hold back a tail that could still become a stop string.
        hold = (
            0
            if seq.finish_reason
            else max((len(s) - 1 for s in self.params.stop_strings), default=0)
        )
        upto = max(seq.emitted, len(text) - hold)
        piece = text[seq.emitted : upto]
        seq.emitted = upto
        return TextDelta(index, piece, token_ids, logprobs, seq.finish_reason, seq.stop_reason)

    def output(self) -> RequestOutput:
        indices = self.final_order if self.final_order is not None else sorted(self.seqs)
        outputs = []
        for new_index, index in enumerate(indices):
            seq = self.seqs[index]
            outputs.append(
                CompletionOutput(
                    index=new_index if self.final_order is not None else index,
                    text=seq.detok.text,
                    token_ids=list(seq.detok.token_ids),
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=seq.logprobs if self.params.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self.prompt_logprobs,
            outputs=outputs,
            finished=self.finished,
            metrics=self.metrics or RequestTimings(self.arrival_time),
            error=self.error,
        )
