"""Which of the scheduler's per-step deltas go to the API servers now, and which wait.

A request whose answer is sent once (not streamed, no stop strings to look for in the text)
needs nothing from the scheduler between its first token and its end. Its deltas after the
first are merged here and sent as one with the last, so that the API server neither wakes up
nor detokenizes for it every step. The first is sent at once, for time to first token; the
merged delta carries the times of the steps it covers, for inter-token latency.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pagedllm.core.request_delta import RequestDelta, SeqDelta


def merge_seq(earlier: SeqDelta, later: SeqDelta) -> SeqDelta:
    """One sequence's two consecutive deltas as one."""
    logprobs = None
    if earlier.new_logprobs is not None or later.new_logprobs is not None:
        logprobs = (earlier.new_logprobs or []) + (later.new_logprobs or [])
    return replace(
        later, new_token_ids=earlier.new_token_ids + later.new_token_ids, new_logprobs=logprobs
    )


def merge(earlier: RequestDelta, later: RequestDelta) -> RequestDelta:
    """Two consecutive deltas of one request as one: what applying both would do."""
    seqs = {s.index: s for s in earlier.seqs}
    for s in later.seqs:
        seqs[s.index] = merge_seq(seqs[s.index], s) if s.index in seqs else s
    return replace(
        later,
        seqs=sorted(seqs.values(), key=lambda s: s.index),
        prompt_logprobs=earlier.prompt_logprobs or later.prompt_logprobs,
        step_times=earlier.step_times + later.step_times,
    )


@dataclass
class OutputBuffer:
    # request id -> the deltas held back since the first token (None before it)
    _held: dict[str, RequestDelta | None] = field(default_factory=dict)

    def hold_after_first(self, request_id: str) -> None:
        """Send ``request_id``'s first delta with tokens and its last; merge what is between."""
        self._held[request_id] = None

    def forget(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    def route(self, deltas: list[RequestDelta], now: float) -> list[RequestDelta]:
        """The deltas to send now, in order; ``now`` stamps the step the held ones came from."""
        out = []
        for delta in deltas:
            if delta.request_id not in self._held:
                out.append(delta)
                continue
            held = self._held[delta.request_id]
            if held is None:
                # Sent as it is: the first token, or what comes before one (an error).
                out.append(delta)
                if any(s.new_token_ids for s in delta.seqs):
                    self._held[delta.request_id] = RequestDelta(delta.request_id)
            else:
                stamped = replace(delta, step_times=[now]) if delta.seqs else delta
                held = self._held[delta.request_id] = merge(held, stamped)
            if delta.finished:
                self._held.pop(delta.request_id)
                if held is not None:
                    out.append(held)
        return out

    def __len__(self) -> int:
        return len(self._held)
