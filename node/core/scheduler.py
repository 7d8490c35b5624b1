"""Iteration-level scheduling over one token budget, with preemption by recompute.

Each step: running sequences first (decode tokens and unfinished prefill chunks), newest
preempted when blocks run out; then waiting sequences in arrival order, prefilled in chunks
as the budget allows. A sequence catches up ``num_computed_tokens`` to ``num_tokens`` whatever
brought it behind (a new prompt, a prefix hit, a resumption after preemption).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.request_delta import RequestDelta, RequestTimings, SeqDelta
from pagedllm.core.sequence import (
    FinishReason,
    Request,
    RequestTimes,
    Sequence,
    SequenceStatus,
)
from pagedllm.core.step_plan import (
    LAST_SAMPLE,
    NewSequence,
    RunningUpdate,
    SamplingSpec,
    SeqSample,
    StepPlan,
    StepResult,
)
from pagedllm.sampling_params import SamplingParams, derive_seed


@dataclass
class SchedulerConfig:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool = True
    seed: int = 0


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


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching, config.seed
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._step_ids = itertools.count()
        self._gone_from_workers: list[int] = []
        # Deltas produced outside update() (unservable requests, beams settled at schedule).
        self._pending_deltas: list[RequestDelta] = []
        self.num_preemptions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0

    # ----- requests in and out -------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
    ) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        request = Request(
            request_id,
            list(prompt_token_ids),
            params,
            tuple(eos_token_ids),
            RequestTimes(arrival_time if arrival_time is not None else time.monotonic()),
        )
        seq = Sequence(next(self._seq_ids), request, list(prompt_token_ids), seed=params.seed)
        request.seqs.append(seq)
        error = self._why_unservable(request)
        if error is not None:
            request.error = error
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = FinishReason.ERROR
            self._pending_deltas.append(self._final_delta(request))
            return
        self.requests[request_id] = request
        self.waiting.append(seq)

    def _why_unservable(self, request: Request) -> str | None:
        cfg = self.config
        if request.prompt_len >= cfg.max_model_len:
            return (
                f"the prompt has {request.prompt_len} tokens but max_model_len is "
                f"{cfg.max_model_len}, which must leave room for at least one output token"
            )
        if self.block_manager.blocks_needed(request.prompt_len + 1) > cfg.num_blocks:
            return (
                f"the prompt has {request.prompt_len} tokens but the KV cache holds only "
                f"{cfg.num_blocks * cfg.block_size}"
            )
        return None

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """End a request at once and free its blocks. False if it is not here."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.seqs:
            if not seq.is_finished:
                self._finish(seq, reason)
        return True

    def stop_sequence(self, request_id: str, index: int, stop: str) -> RequestDelta | None:
        """End one sequence on a stop string; the request's final delta if that ended it."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        for seq in request.seqs:
            if seq.index == index and not seq.is_finished:
                self._finish(seq, FinishReason.STOP)
                seq.stop_reason = stop
        if not request.is_finished:
            return None
        delta = RequestDelta(request_id)
        self._finish_delta(request, delta)
        return delta

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._pending_deltas)

    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            num_running=len({s.request.request_id for s in self.running}),
            num_waiting=len({s.request.request_id for s in self.waiting}),
            kv_usage=bm.usage,
            prefix_queries=bm.prefix_queries,
            prefix_hits=bm.prefix_hits,
            num_preemptions=self.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
        )

    # ----- scheduling ----------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        self._settle_beams()
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new == 0:
                i += 1
                continue
            while not self.block_manager.allocate(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                scheduled.append((seq, num_new))
                budget -= num_new
                i += 1
        while (
            not preempted and self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs
        ):
            seq = self.waiting[0]
            hit = self.block_manager.find_prefix(seq)
            computed = min(hit.num_tokens, seq.num_tokens - 1)
            num_new = min(seq.num_tokens - computed, budget)
            if not self.block_manager.allocate(seq, num_new, hit):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            request = seq.request
            if request.times.first_scheduled is None:
                request.times.first_scheduled = time.monotonic()
                self.prompt_tokens += request.prompt_len
            scheduled.append((seq, num_new))
            budget -= num_new
        return self._plan(scheduled)

    def schedule_ahead(self, in_flight: StepPlan) -> StepPlan | None:
        """The plan after ``in_flight``, made before its results are in (async scheduling).

        Each sequence that samples in ``in_flight`` takes a ``LAST_SAMPLE`` placeholder for
        the token it is about to get, which the workers fill in themselves; ``update`` puts the
        real token in its place. Sequences whose next token may end them (``max_tokens``,
        ``max_model_len``), that fan out, or beam searches wait for the results instead; with
        beams in the node this returns None (no plan ahead).
        """
        if any(r.params.use_beam_search for r in self.requests.values()):
            return None
        by_id = {s.seq_id: s for s in self.running}
        for seq_id, _ in in_flight.scheduled:
            seq = by_id.get(seq_id)
            if seq is None or seq.num_computed_tokens != seq.num_tokens or seq.pending_sample:
                continue
            if in_flight.num_samples.get(seq_id, 1) != 1 or self._at_length_limit(seq, 1):
                continue
            seq.token_ids.append(LAST_SAMPLE)
            seq.pending_sample = True
        return self.schedule()

    def _drop_pending(self, seq: Sequence) -> None:
        """Take back the placeholder of a sample still in flight (its sample is dropped)."""
        if seq.pending_sample:
            seq.token_ids.pop()
            seq.pending_sample = False

    def _plan(self, scheduled: list[tuple[Sequence, int]]) -> StepPlan:
        plan = StepPlan(step_id=next(self._step_ids))
        plan.finished, self._gone_from_workers = self._gone_from_workers, []
        plan.block_copies = self.block_manager.take_copies()
        for seq, num_new in scheduled:
            if not seq.in_workers:
                plan.new.append(
                    NewSequence(
                        seq_id=seq.seq_id,
                        token_ids=list(seq.token_ids),
                        prompt_len=seq.prompt_len,
                        block_ids=list(seq.block_ids),
                        num_computed_tokens=seq.num_computed_tokens,
                        num_kv_tokens=seq.num_kv_tokens,
                        sampling=self._sampling_spec(seq),
                    )
                )
                seq.in_workers = True
            else:
                plan.running.append(
                    RunningUpdate(
                        seq_id=seq.seq_id,
                        new_token_ids=seq.token_ids[seq.worker_tokens :],
                        blocks_from=seq.worker_blocks,
                        block_ids=seq.block_ids[seq.worker_blocks :],
                        num_computed_tokens=seq.num_computed_tokens,
                    )
                )
            seq.worker_tokens = seq.num_tokens
            seq.worker_blocks = len(seq.block_ids)
            plan.scheduled.append((seq.seq_id, num_new))
            seq.num_computed_tokens += num_new
            seq.num_kv_tokens = max(seq.num_kv_tokens, seq.num_computed_tokens)
            request = seq.request
            fan_out = (
                request.params.num_sequences > 1
                and not request.params.use_beam_search
                and len(request.seqs) == 1
                and seq.num_output_tokens == 0
                and seq.num_computed_tokens == seq.num_tokens
            )
            if fan_out:
                plan.num_samples[seq.seq_id] = request.params.num_sequences
        return plan

    def _sampling_spec(self, seq: Sequence) -> SamplingSpec:
        p = seq.params
        blocked = [] if p.ignore_eos else list(seq.request.eos_token_ids)
        blocked += list(p.stop_token_ids or [])
        return SamplingSpec(
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            min_p=p.min_p,
            seed=seq.seed,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
            min_tokens=p.min_tokens,
            min_tokens_blocked=blocked,
            logprobs=p.logprobs,
            prompt_logprobs=p.prompt_logprobs,
            beam_width=p.beam_width if p.use_beam_search else 0,
        )

    def _preempt(self, seq: Sequence) -> None:
        self._drop_pending(seq)
        self.block_manager.free(seq)
        self._forget_in_workers(seq)
        seq.status = SequenceStatus.WAITING
        seq.beam_candidates = None
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        seq.request.num_preemptions += 1

    def _forget_in_workers(self, seq: Sequence) -> None:
        if seq.in_workers:
            self._gone_from_workers.append(seq.seq_id)
        seq.in_workers = False
        seq.worker_tokens = 0
        seq.worker_blocks = 0

    def _finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | None = None) -> None:
        self._drop_pending(seq)
        self.block_manager.free(seq)
        self._forget_in_workers(seq)
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    # ----- results -------------------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestDelta]:  # noqa: C901 (to split)
        """Apply the workers' samples; return what changed for each request."""
        touched: dict[str, Request] = {}
        reported: dict[int, int] = {}
        by_id = {s.seq_id: s for s in self.running}
        for running in self.running:  # the samples the placeholders stood for are in
            self._drop_pending(running)
        for seq_id, _ in plan.scheduled:
            seq = by_id.get(seq_id)
            if seq is not None:
                self.block_manager.register_computed(seq)
        for part in result.prompt_logprobs:
            seq = by_id.get(part.seq_id)
            if seq is None:
                continue
            request = seq.request
            for k, (lp, top) in enumerate(zip(part.token_logprobs, part.top_logprobs, strict=True)):
                entry = {request.prompt_token_ids[part.start + k]: lp}
                entry.update({t: v for t, v in top if t not in entry})
                request.prompt_logprobs.append(entry)
            touched[request.request_id] = request
        for sample in result.samples:
            seq = by_id.get(sample.seq_id)
            if seq is None or seq.status != SequenceStatus.RUNNING:
                continue
            request = seq.request
            touched[request.request_id] = request
            if request.params.use_beam_search:
                seq.beam_candidates = list(zip(sample.token_ids, sample.logprobs, strict=True))
                continue
            reported.setdefault(seq.seq_id, seq.num_tokens)
            if len(sample.token_ids) > 1:
                self._fan_out(seq, sample, reported)
            else:
                self._append(seq, sample, 0)
        for request in touched.values():
            if request.params.use_beam_search:
                self._beam_step(request)
        deltas, self._pending_deltas = self._pending_deltas, []
        for request in touched.values():
            deltas.append(self._delta(request, reported))
        return deltas

    def _append(self, seq: Sequence, sample: SeqSample, j: int) -> None:
        token = sample.token_ids[j]
        seq.token_ids.append(token)
        seq.cumulative_logprob += sample.logprobs[j]
        if seq.params.logprobs is not None:
            entry = {token: sample.logprobs[j]}
            if sample.top_logprobs is not None:
                entry.update({t: v for t, v in sample.top_logprobs[j] if t not in entry})
            seq.output_logprobs.append(entry)
        self.generation_tokens += 1
        request = seq.request
        now = time.monotonic()
        if request.times.first_token is None:
            request.times.first_token = now
        request.times.last_token = now
        reason, stop_reason = self._stop_check(seq, token)
        if reason is not None:
            self._finish(seq, reason, stop_reason)

    def _stop_check(self, seq: Sequence, token: int) -> tuple[FinishReason | None, int | None]:
        p = seq.params
        out = seq.num_output_tokens
        if out >= p.min_tokens:
            if not p.ignore_eos and token in seq.request.eos_token_ids:
                return FinishReason.STOP, None
            if token in (p.stop_token_ids or ()):
                return FinishReason.STOP, token
        if self._at_length_limit(seq):
            return FinishReason.LENGTH, None
        return None, None

    def _at_length_limit(self, seq: Sequence, more: int = 0) -> bool:
        """Whether ``seq``, given ``more`` tokens, has as many as max_tokens or max_model_len
        allow."""
        max_tokens = seq.params.max_tokens
        return (
            max_tokens is not None and seq.num_output_tokens + more >= max_tokens
        ) or seq.num_tokens + more >= self.config.max_model_len

    def _fork(self, parent: Sequence, index: int) -> Sequence:
        request = parent.request
        child = Sequence(
            next(self._seq_ids),
            request,
            list(parent.token_ids),
            index=index,
            seed=derive_seed(request.params.seed, index),
            status=SequenceStatus.RUNNING,
            num_computed_tokens=parent.num_computed_tokens,
            num_kv_tokens=parent.num_kv_tokens,
            cumulative_logprob=parent.cumulative_logprob,
            output_logprobs=list(parent.output_logprobs),
        )
        self.block_manager.fork(parent, child)
        request.seqs.append(child)
        self.running.append(child)
        return child

    def _fan_out(self, seq: Sequence, sample: SeqSample, reported: dict[int, int]) -> None:
        children = [self._fork(seq, j) for j in range(1, len(sample.token_ids))]
        for j, child in enumerate(children, start=1):
            reported[child.seq_id] = child.num_tokens
            self._append(child, sample, j)
        self._append(seq, sample, 0)

    # ----- beam search ---------------------------------------------------------------------

    def _settle_beams(self) -> None:
        """Run beam selection for searches whose unfinished siblings were preempted since."""
        pending = {
            s.request.request_id: s.request for s in self.running if s.beam_candidates is not None
        }
        for request in pending.values():
            self._beam_step(request)
            if not request.seqs:
                self._pending_deltas.append(self._delta(request, {}))

    def _beam_step(self, request: Request) -> None:  # noqa: C901 (to split)
        live = [s for s in request.seqs if s.status == SequenceStatus.RUNNING]
        if not live or any(s.beam_candidates is None for s in live):
            return
        # A beam preempted for memory drops out of the search rather than stall it.
        for seq in request.seqs:
            if seq.status == SequenceStatus.WAITING:
                self._finish(seq, FinishReason.ABORT)
        p = request.params
        width = p.beam_width
        ranked = sorted(
            (
                (s.cumulative_logprob + lp, s, tok, lp)
                for s in live
                for tok, lp in s.beam_candidates or ()
            ),
            key=lambda c: -c[0],
        )
        chosen: list[tuple[Sequence, int, float]] = []
        for _, seq, tok, lp in ranked:
            if len(chosen) == width:
                break
            is_eos = not p.ignore_eos and tok in request.eos_token_ids
            if is_eos and seq.num_output_tokens + 1 > p.min_tokens:
                if len(request.finished_beams) < width:
                    done = Sequence(
                        next(self._seq_ids),
                        request,
                        seq.token_ids + [tok],
                        status=SequenceStatus.FINISHED,
                        finish_reason=FinishReason.STOP,
                        cumulative_logprob=seq.cumulative_logprob + lp,
                    )
                    request.finished_beams.append(done)
                continue
            chosen.append((seq, tok, lp))
        for seq in live:
            seq.beam_candidates = None
        keep: dict[int, list[tuple[int, float]]] = {}
        for seq, tok, lp in chosen:
            keep.setdefault(seq.seq_id, []).append((tok, lp))
        new_seqs: list[Sequence] = []
        for seq in live:
            picks = keep.get(seq.seq_id, [])
            if not picks:
                self._finish(seq, FinishReason.ABORT)
                continue
            branches = [self._fork(seq, 0) for _ in picks[1:]]
            for target, (tok, lp) in zip([seq, *branches], picks, strict=True):
                self._append(target, SeqSample(target.seq_id, [tok], [lp]), 0)
                new_seqs.append(target)
        request.seqs = new_seqs
        search_over = len(request.finished_beams) >= width or not new_seqs
        if search_over or all(s.is_finished for s in new_seqs):
            for seq in new_seqs:
                if not seq.is_finished:
                    self._finish(seq, FinishReason.LENGTH)
            request.finished_beams.extend(s for s in new_seqs)
            request.seqs = []

    # ----- reporting -----------------------------------------------------------------------

    def _delta(self, request: Request, reported: dict[int, int]) -> RequestDelta:
        """New tokens of each sequence since the last report; the request's end if it ended."""
        p = request.params
        finished = request.is_finished and (not p.use_beam_search or not request.seqs)
        if finished and p.use_beam_search:
            return self._final_delta(request)
        delta = RequestDelta(request.request_id)
        for seq in request.seqs:
            start = reported.get(seq.seq_id)
            if start is not None:
                delta.seqs.append(self._seq_delta(seq, start))
        complete = len(request.prompt_logprobs) == request.prompt_len - 1
        if p.prompt_logprobs is not None and complete and not request.prompt_logprobs_sent:
            delta.prompt_logprobs = [None, *request.prompt_logprobs]
            request.prompt_logprobs_sent = True
        if finished:
            self._finish_delta(request, delta)
        return delta

    def _seq_delta(self, seq: Sequence, start: int) -> SeqDelta:
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

    def _final_delta(self, request: Request) -> RequestDelta:
        """A request whose outputs were never reported: all of them at once, best first."""
        p = request.params
        delta = RequestDelta(request.request_id)
        if p.use_beam_search:

            def score(s: Sequence) -> float:
                return s.cumulative_logprob / (max(1, s.num_output_tokens) ** p.length_penalty)

            best = sorted(request.finished_beams, key=score, reverse=True)[: p.n]
            for i, seq in enumerate(best):
                seq.index = i
            delta.seqs = [self._seq_delta(s, s.prompt_len) for s in best]
        else:
            delta.seqs = [self._seq_delta(s, s.prompt_len) for s in request.seqs]
        if p.prompt_logprobs is not None and request.prompt_logprobs:
            delta.prompt_logprobs = [None, *request.prompt_logprobs]
        self._finish_delta(request, delta)
        return delta

    def _finish_delta(self, request: Request, delta: RequestDelta) -> None:
        self.requests.pop(request.request_id, None)
        now = time.monotonic()
        p = request.params
        delta.finished = True
        delta.error = request.error
        if p.use_beam_search:
            delta.final_order = [s.index for s in delta.seqs]
        elif p.num_sequences > p.n:
            best = sorted(request.seqs, key=lambda s: s.cumulative_logprob, reverse=True)
            delta.final_order = [s.index for s in best[: p.n]]
        t = request.times
        t.finished = now
        delta.timings = RequestTimings(
            arrival=t.arrival,
            queued=(t.first_scheduled or now) - t.arrival,
            first_token=(t.first_token - t.arrival) if t.first_token else None,
            finished=now - t.arrival,
        )
