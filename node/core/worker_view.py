"""What the workers hold of each sequence, and the step plan that brings them up to date.

The workers keep their own copy of every running sequence's tokens and block table. Each plan
sends only the difference: a sequence new to them in full, one they hold as the tokens after
those they have and the block table from its first changed entry on (copy-on-write replaces
entries they already hold). Compiled grammars travel the same way: each once, with the first
plan that needs it, and the workers keep the last ``GRAMMARS_HELD`` used until told to drop one.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from pagedllm.core.sequence import Sequence
from pagedllm.core.step_plan import NewSequence, RunningUpdate, SamplingSpec, StepPlan

# Compiled grammars the workers keep (a sequence's matcher holds its own grammar, so dropping
# one only means sending it again when a new sequence needs it).
GRAMMARS_HELD = 64


@dataclass
class _Held:
    """The workers' copy of one sequence."""

    num_tokens: int
    block_ids: list[int]


def _first_change(held: list[int], table: list[int]) -> int:
    """Where ``table`` stops extending ``held``: the entries to send start there."""
    n = len(held)
    if table[:n] == held:
        return n
    return next(
        (i for i, (a, b) in enumerate(zip(held, table, strict=False)) if a != b), min(n, len(table))
    )


def sampling_spec(seq: Sequence) -> SamplingSpec:
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
        grammar_key=None if seq.request.grammar is None else seq.request.grammar.key,
        logit_bias=dict(p.logit_bias or {}),
        allowed_token_ids=None if p.allowed_token_ids is None else list(p.allowed_token_ids),
        bad_words_ids=[list(w) for w in p.bad_words_token_ids or []],
    )


class WorkerView:
    def __init__(self) -> None:
        self._held: dict[int, _Held] = {}
        # Sequences the workers hold but must drop with the next plan.
        self._gone: list[int] = []
        self._step_ids = itertools.count()
        # Keys of the grammars the workers hold, least recently used first.
        self._grammars: OrderedDict[str, None] = OrderedDict()

    def forget(self, seq: Sequence) -> None:
        """``seq`` left the running batch (preempted or finished): the workers drop it."""
        if self._held.pop(seq.seq_id, None) is not None:
            self._gone.append(seq.seq_id)

    def plan(
        self,
        scheduled: list[tuple[Sequence, int]],
        block_copies: list[tuple[int, int]],
        drafts: dict[int, list[int]] | None = None,
    ) -> StepPlan:
        """The next step for the workers: compute ``scheduled`` (sequence, new tokens, drafts
        included) as the sequences stand now, after the block copies and dropping the sequences
        gone; ``drafts`` (seq_id -> tokens) are verified after each sequence's known tokens."""
        plan = StepPlan(step_id=next(self._step_ids), finished=self._gone)
        plan.block_copies = block_copies
        plan.drafts = drafts or {}
        self._gone = []
        for seq, num_new in scheduled:
            table = seq.blocks.ids
            held = self._held.get(seq.seq_id)
            if held is None:
                self._send_grammar(seq, plan)
                plan.new.append(
                    NewSequence(
                        seq_id=seq.seq_id,
                        token_ids=list(seq.token_ids),
                        prompt_len=seq.prompt_len,
                        block_ids=list(table),
                        num_computed_tokens=seq.num_computed_tokens,
                        num_kv_tokens=seq.num_kv_tokens,
                        sampling=sampling_spec(seq),
                        lora=seq.request.lora,
                    )
                )
                self._held[seq.seq_id] = _Held(seq.num_tokens, list(table))
            else:
                start = _first_change(held.block_ids, table)
                plan.running.append(
                    RunningUpdate(
                        seq_id=seq.seq_id,
                        new_token_ids=seq.token_ids[held.num_tokens :],
                        blocks_from=start,
                        block_ids=table[start:],
                        num_computed_tokens=seq.num_computed_tokens,
                    )
                )
                held.num_tokens = seq.num_tokens
                held.block_ids[start:] = table[start:]
            plan.scheduled.append((seq.seq_id, num_new))
        return plan

    def _send_grammar(self, seq: Sequence, plan: StepPlan) -> None:
        """Make sure the workers hold the grammar ``seq`` follows, if any."""
        grammar = seq.request.grammar
        if grammar is None:
            return
        if grammar.key in self._grammars:
            self._grammars.move_to_end(grammar.key)
            return
        plan.grammars[grammar.key] = grammar.data
        self._grammars[grammar.key] = None
        if len(self._grammars) > GRAMMARS_HELD:
            oldest, _ = self._grammars.popitem(last=False)
            plan.dropped_grammars.append(oldest)
