"""Iteration-level scheduling over one token budget, with preemption by recompute.

Each step: running sequences first (decode tokens and unfinished prefill chunks), newest
preempted when blocks run out; then waiting sequences in arrival order, prefilled in chunks
as the budget allows. A sequence catches up ``num_computed_tokens`` to ``num_tokens`` whatever
brought it behind (a new prompt, a prefix hit, a resumption after preemption). The workers'
results come back through ``update``; what the workers hold (``worker_view``), beam selection
(``beam_search``) and what is reported (``reporting``) each have their own module.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace

from pagedllm.core import reporting
from pagedllm.core.adapter_lru import AdapterLRU
from pagedllm.core.beam_search import BeamSearch
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.kv_map import waste_fraction
from pagedllm.core.lora_request import LoRARequest
from pagedllm.core.ngram_proposer import propose
from pagedllm.core.reporting import SchedulerStats, SpecDecodeStats
from pagedllm.core.request_delta import RequestDelta, RequestTimings
from pagedllm.core.sequence import FinishReason, GrammarRef, Request, Sequence, SequenceStatus
from pagedllm.core.speculative import SpeculativeConfig
from pagedllm.core.step_plan import LAST_SAMPLE, PromptLogprobs, SeqSample, StepPlan, StepResult
from pagedllm.core.worker_view import WorkerView
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
    speculative: SpeculativeConfig | None = None
    # The most LoRA adapters one step may run (0: requests may name none).
    max_loras: int = 0
    # The most the workers keep loaded (0: max_loras); the scheduler's LRU decides which.
    max_cpu_loras: int = 0


# The most steps a sequence whose drafts keep gaining nothing goes without drafting.
MAX_SPEC_PAUSE = 128


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching, config.seed
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Request] = {}
        self.workers = WorkerView()
        # What the workers hold loaded, decided here and sent with each plan.
        self.loras: AdapterLRU | None = (
            AdapterLRU(config.max_cpu_loras or config.max_loras) if config.max_loras else None
        )
        self._seq_ids = itertools.count()
        self._beams = BeamSearch(
            finish=self._finish,
            fork=lambda parent: self._fork(parent, 0),
            extend=lambda seq, token, logprob: self._append(
                seq, SeqSample(seq.seq_id, [token], [logprob]), 0
            ),
            new_seq_id=lambda: next(self._seq_ids),
        )
        # Deltas produced outside update() (unservable requests, beams settled at schedule).
        self._pending_deltas: list[RequestDelta] = []
        self.num_preemptions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        spec = config.speculative
        self.spec_stats = SpecDecodeStats(
            accepted_per_pos=[0] * (spec.num_speculative_tokens if spec else 0)
        )

    # ----- requests in and out -------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
        grammar: GrammarRef | None = None,
        lora: LoRARequest | None = None,
    ) -> None:
        """Queue a request; one with structured outputs comes with its compiled ``grammar``,
        one for a LoRA adapter names it (``lora``)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        if (params.structured_outputs is None) != (grammar is None):
            raise ValueError("a request has a compiled grammar exactly when it is constrained")
        if lora is not None and not self.config.max_loras:
            raise ValueError(f"LoRA adapter {lora.lora_name!r} asked for, but LoRA is not enabled")
        request = Request(
            request_id,
            list(prompt_token_ids),
            params,
            tuple(eos_token_ids),
            RequestTimings(arrival_time if arrival_time is not None else time.monotonic()),
            grammar=grammar,
            lora=lora,
        )
        seq = Sequence(next(self._seq_ids), request, list(prompt_token_ids), seed=params.seed)
        request.seqs.append(seq)
        error = self._why_unservable(request)
        if error is not None:
            request.error = error
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = FinishReason.ERROR
            self._pending_deltas.append(reporting.final_delta(request))
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
        self.requests.pop(request_id)
        delta = RequestDelta(request_id)
        reporting.end(request, delta)
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
            kv_waste=waste_fraction(self.running, bm),
            kv_shared_blocks=bm.pool.num_shared,
            spec_decode=None
            if self.config.speculative is None
            else replace(self.spec_stats, accepted_per_pos=list(self.spec_stats.accepted_per_pos)),
            max_loras=self.config.max_loras,
            running_adapters=_adapters(self.running) if self.config.max_loras else (),
            waiting_adapters=_adapters(self.waiting) if self.config.max_loras else (),
            lora_loads=0 if self.loras is None else self.loras.num_loads,
            loaded_adapters=() if self.loras is None else tuple(self.loras.held),
        )

    # ----- scheduling ----------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """The next step, made with every sample in: decoding sequences may draft."""
        return self._schedule(drafting=self._speculating())

    def _speculating(self) -> bool:
        """Whether steps draft now: speculation is on and the node holds no more requests
        than its ``disable_by_batch_size`` (vLLM's rule)."""
        spec = self.config.speculative
        if spec is None:
            return False
        most = spec.disable_by_batch_size
        return most is None or len(self.running) + len(self.waiting) <= most

    def _schedule(self, drafting: bool) -> StepPlan:
        for request in self._beams.settle(self.running):
            self._pending_deltas.append(self._report(request, {}))
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        drafts: dict[int, list[int]] = {}
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new == 0:
                i += 1
                continue
            draft = self._draft(seq, budget) if drafting and num_new == 1 else []
            # Drafts take blocks only where they are free: short of them, the sequence steps
            # without (and preempts, if it must, for its one token).
            if draft and self.block_manager.allocate(seq, 1 + len(draft)):
                drafts[seq.seq_id] = draft
                scheduled.append((seq, 1 + len(draft)))
                budget -= 1 + len(draft)
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
        # A step runs at most max_loras adapters: a waiting sequence for another one waits
        # (those behind it may go ahead) until a running adapter's sequences are done.
        adapters = {_adapter(s) for s in self.running}
        passed: list[Sequence] = []
        while (
            not preempted and self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs
        ):
            seq = self.waiting[0]
            if self._waits_for_adapter(seq, adapters):
                passed.append(self.waiting.popleft())
                continue
            hit = self.block_manager.find_prefix(seq)
            computed = min(hit.num_tokens, seq.num_tokens - 1)
            num_new = min(seq.num_tokens - computed, budget)
            if not self.block_manager.allocate(seq, num_new, hit):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            request = seq.request
            if request.timings.first_scheduled_time is None:
                request.timings.first_scheduled_time = time.monotonic()
                self.prompt_tokens += request.prompt_len
            adapters.add(_adapter(seq))
            scheduled.append((seq, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(passed))
        return self._plan(scheduled, drafts)

    def _waits_for_adapter(self, seq: Sequence, running: set[tuple[str, str] | None]) -> bool:
        """Whether ``seq`` needs a LoRA adapter beyond the ``max_loras`` already running."""
        name = _adapter(seq)
        return (
            name is not None
            and name not in running
            and len(running - {None}) >= self.config.max_loras
        )

    def _may_draft(self, seq: Sequence) -> bool:
        """Whether ``seq`` drafts when next it decodes. Sequences whose sampling follows more
        than the model's distribution token by token (log probabilities, grammars, beams) step
        without drafts, as does one pausing after drafts that gained nothing."""
        p = seq.params
        return (
            seq.spec_pause == 0
            and seq.num_output_tokens > 0
            and not seq.pending_sample
            and p.logprobs is None
            and not p.use_beam_search
            and seq.request.grammar is None
        )

    def _draft(self, seq: Sequence, budget: int) -> list[int]:
        """Draft tokens for ``seq``'s next decode step, within the token budget and the
        length limits (the step yields up to one more token than its drafts)."""
        spec = self.config.speculative
        if spec is None or not self._may_draft(seq):
            return []
        room = self.config.max_model_len - seq.num_tokens - 1
        max_tokens = seq.params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - seq.num_output_tokens - 1)
        k = min(spec.num_speculative_tokens, budget - 1, room)
        if k < 1:
            return []
        draft = propose(seq.token_ids, k, spec.prompt_lookup_min, spec.prompt_lookup_max)
        if not draft:
            self._spec_miss(seq)
        return draft

    def _spec_miss(self, seq: Sequence) -> None:
        """A draft attempt gained nothing: pause drafting, twice as long as the last time."""
        seq.spec_misses += 1
        seq.spec_pause = min(2**seq.spec_misses, MAX_SPEC_PAUSE)

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
        # Speculation meets async scheduling here: drafts continue known tokens, which a
        # placeholder is not, so while any running sequence would draft the node schedules
        # synchronously (no plan ahead: the next plan is made with every sample in). Sequences
        # pausing their drafts, or never drafting, or a batch too large to draft, let the node
        # plan ahead again.
        if self._speculating() and any(self._may_draft(s) for s in self.running):
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
        return self._schedule(drafting=False)

    def _drop_pending(self, seq: Sequence) -> None:
        """Take back the placeholder of a sample still in flight (its sample is dropped)."""
        if seq.pending_sample:
            seq.token_ids.pop()
            seq.pending_sample = False

    def _plan(
        self, scheduled: list[tuple[Sequence, int]], drafts: dict[int, list[int]]
    ) -> StepPlan:
        """The workers' plan for ``scheduled``; the sequences then count those tokens done
        (drafts not yet: ``update`` counts those accepted)."""
        plan = self.workers.plan(scheduled, self.block_manager.take_copies(), drafts)
        if self.loras is not None:
            step = (seq.request.lora for seq, _ in scheduled)
            plan.lora_loads, plan.lora_drops = self.loras.use(a for a in step if a is not None)
        for seq, num_new in scheduled:
            seq.num_computed_tokens += num_new - len(drafts.get(seq.seq_id, ()))
            seq.num_kv_tokens = max(seq.num_kv_tokens, seq.num_computed_tokens)
            params = seq.params
            fan_out = (
                params.num_sequences > 1
                and not params.use_beam_search
                and len(seq.request.seqs) == 1
                and seq.num_output_tokens == 0
                and seq.num_computed_tokens == seq.num_tokens
            )
            if fan_out:
                plan.num_samples[seq.seq_id] = params.num_sequences
        return plan

    def _preempt(self, seq: Sequence) -> None:
        self._drop_pending(seq)
        self.block_manager.free(seq)
        self.workers.forget(seq)
        seq.status = SequenceStatus.WAITING
        seq.beam_candidates = None
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | None = None) -> None:
        self._drop_pending(seq)
        self.block_manager.free(seq)
        self.workers.forget(seq)
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    # ----- results -------------------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestDelta]:
        """Apply the workers' samples; return what changed for each request."""
        by_id = {s.seq_id: s for s in self.running}
        for running in self.running:  # the samples the placeholders stood for are in
            self._drop_pending(running)
        for seq_id, _ in plan.scheduled:
            seq = by_id.get(seq_id)
            if seq is not None:
                self.block_manager.register_computed(seq)
        touched = self._take_prompt_logprobs(result.prompt_logprobs, by_id)
        # seq id -> its token count before this step's samples (where its delta starts)
        reported: dict[int, int] = {}
        for sample in result.samples:
            seq = by_id.get(sample.seq_id)
            if seq is None or seq.status != SequenceStatus.RUNNING:
                continue
            touched[seq.request.request_id] = seq.request
            draft = plan.drafts.get(seq.seq_id)
            if draft is not None:
                self._take_verified(seq, sample, draft, reported)
                continue
            if seq.spec_pause > 0:
                seq.spec_pause -= 1
            self._take_sample(seq, sample, reported)
        for request in touched.values():
            if request.params.use_beam_search:
                self._beams.step(request)
        deltas, self._pending_deltas = self._pending_deltas, []
        deltas += [self._report(request, reported) for request in touched.values()]
        return deltas

    def _take_prompt_logprobs(
        self, parts: list[PromptLogprobs], by_id: dict[int, Sequence]
    ) -> dict[str, Request]:
        """Add the prompt log probabilities that came in; the requests they belong to."""
        touched: dict[str, Request] = {}
        for part in parts:
            seq = by_id.get(part.seq_id)
            if seq is None:
                continue
            request = seq.request
            for k, (lp, top) in enumerate(zip(part.token_logprobs, part.top_logprobs, strict=True)):
                entry = {request.prompt_token_ids[part.start + k]: lp}
                entry.update({t: v for t, v in top if t not in entry})
                request.prompt_logprobs.append(entry)
            touched[request.request_id] = request
        return touched

    def _take_sample(self, seq: Sequence, sample: SeqSample, reported: dict[int, int]) -> None:
        if seq.params.use_beam_search:
            seq.beam_candidates = list(zip(sample.token_ids, sample.logprobs, strict=True))
            return
        reported.setdefault(seq.seq_id, seq.num_tokens)
        if len(sample.token_ids) > 1:
            self._fan_out(seq, sample, reported)
        else:
            self._append(seq, sample, 0)

    def _take_verified(
        self, seq: Sequence, sample: SeqSample, draft: list[int], reported: dict[int, int]
    ) -> None:
        """The accepted drafts and the workers' own token: appended one by one, so that the
        stop conditions cut them exactly where a step per token would have stopped."""
        # The workers answer the agreeing prefix and one more; anything past that is not kept.
        accepted = 0
        limit = min(len(draft), len(sample.token_ids) - 1)
        while accepted < limit and sample.token_ids[accepted] == draft[accepted]:
            accepted += 1
        stats = self.spec_stats
        stats.num_drafts += 1
        stats.num_draft_tokens += len(draft)
        stats.num_accepted_tokens += accepted
        for pos in range(accepted):
            stats.accepted_per_pos[pos] += 1
        reported.setdefault(seq.seq_id, seq.num_tokens)
        for j in range(min(accepted + 1, len(sample.token_ids))):
            self._append(seq, sample, j)
            if seq.is_finished:
                return
        # The verification pass wrote the accepted drafts' K/V; the rejected ones' slots go back.
        seq.num_computed_tokens += accepted
        seq.num_kv_tokens = max(seq.num_kv_tokens, seq.num_computed_tokens)
        self.block_manager.trim(seq)
        if accepted:
            seq.spec_misses = 0
        else:
            self._spec_miss(seq)

    def _report(self, request: Request, reported: dict[int, int]) -> RequestDelta:
        delta = reporting.step_delta(request, reported)
        if delta.finished:
            self.requests.pop(request.request_id, None)
        return delta

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
        if request.timings.first_token_time is None:
            request.timings.first_token_time = time.monotonic()
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


def _adapter(seq: Sequence) -> tuple[str, str] | None:
    lora = seq.request.lora
    return None if lora is None else lora.key


def _adapters(seqs: Iterable[Sequence]) -> tuple[str, ...]:
    """The names of the adapters of ``seqs``."""
    return tuple(sorted({s.request.lora.lora_name for s in seqs if s.request.lora is not None}))
