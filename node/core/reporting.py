"""What the scheduler reports: each request's delta after a step, its end, and the counters.

A delta carries the tokens each sequence gained since the last report; a request's final delta
also carries which sequences to return and its timings. The scheduler forgets a request once
its final delta is made.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from pagedllm.core.request_delta import RequestDelta, SeqDelta
from pagedllm.core.sequence import Request, Sequence


@dataclass
class SpecDecodeStats:
    """vLLM's speculative-decoding counters: drafts verified, their tokens, those accepted
    (in all, and by position in the draft)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_queries: int
    prefix_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    # Allocated KV slots holding no token, over allocated slots (see ``kv_map``).
    kv_waste: float
    # Blocks referenced by more than one sequence.
    kv_shared_blocks: int
    # None when speculative decoding is off.
    spec_decode: SpecDecodeStats | None = None
    # LoRA: the most adapters a step runs (0: off), and those of running and waiting requests.
    max_loras: int = 0
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    # Adapter loads the scheduler sent the workers so far, and the adapters loaded now (their
    # LoRARequest.key, least recently used first).
    lora_loads: int = 0
    loaded_adapters: tuple[tuple[str, str], ...] = ()


def step_delta(request: Request, reported: dict[int, int]) -> RequestDelta:
    """New tokens of each sequence since the last report (``reported``: seq id -> the token
    count at that report); the request's end if it ended."""
    p = request.params
    finished = request.is_finished and (not p.use_beam_search or not request.seqs)
    if finished and p.use_beam_search:
        return final_delta(request)
    delta = RequestDelta(request.request_id)
    for seq in request.seqs:
        start = reported.get(seq.seq_id)
        if start is not None:
            delta.seqs.append(_seq_delta(seq, start))
    complete = len(request.prompt_logprobs) == request.prompt_len - 1
    if p.prompt_logprobs is not None and complete and not request.prompt_logprobs_sent:
        delta.prompt_logprobs = [None, *request.prompt_logprobs]
        request.prompt_logprobs_sent = True
    if finished:
        end(request, delta)
    return delta


def _seq_delta(seq: Sequence, start: int) -> SeqDelta:
    first_output = start - seq.prompt_len
    logprobs = seq.output_logprobs[first_output:] if seq.params.logprobs is not None else None
    return SeqDelta(
        index=seq.index,
        new_token_ids=seq.token_ids[start:],
        new_logprobs=logprobs,
        cumulative_logprob=seq.cumulative_logprob,
        finish_reason=seq.finish_reason.value if seq.finish_reason else None,
        stop_reason=seq.stop_reason,
    )


def final_delta(request: Request) -> RequestDelta:
    """A request whose outputs were never reported: all of them at once, best first."""
    p = request.params
    delta = RequestDelta(request.request_id)
    if p.use_beam_search:

        def score(s: Sequence) -> float:
            return s.cumulative_logprob / (max(1, s.num_output_tokens) ** p.length_penalty)

        best = sorted(request.finished_beams, key=score, reverse=True)[: p.n]
        for i, seq in enumerate(best):
            seq.index = i
        delta.seqs = [_seq_delta(s, s.prompt_len) for s in best]
    else:
        delta.seqs = [_seq_delta(s, s.prompt_len) for s in request.seqs]
    if p.prompt_logprobs is not None and request.prompt_logprobs:
        delta.prompt_logprobs = [None, *request.prompt_logprobs]
    end(request, delta)
    return delta


def end(request: Request, delta: RequestDelta) -> None:
    """Make ``delta`` the request's last: its error, the sequences to return, its timings."""
    p = request.params
    delta.finished = True
    delta.error = request.error
    if p.use_beam_search:
        delta.final_order = [s.index for s in delta.seqs]
    elif p.num_sequences > p.n:
        best = sorted(request.seqs, key=lambda s: s.cumulative_logprob, reverse=True)
        delta.final_order = [s.index for s in best[: p.n]]
    request.timings.finished_time = time.monotonic()
    delta.timings = replace(request.timings)
