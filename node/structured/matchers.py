"""Worker rank 0's side of structured outputs: one grammar matcher per constrained sequence,
and the batch's token bitmask.

A matcher is derived from its sequence's tokens, not from what the worker sampled: before
each sample it accepts the output tokens it has not seen yet. So it follows the sequence
whatever happened to it: a preempted sequence comes back as a new one and its matcher is
rebuilt from its tokens, an n > 1 fork gets a matcher of its own, a token of the step before
that arrives as a placeholder (async scheduling) is accepted once the worker has filled it in,
and a sequence ended by a stop string is dropped with its matcher.

The mask of a step depends only on tokens known before the step runs, so it is filled on a
thread of its own while the model runs (xgrammar releases the GIL while it fills).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch
import xgrammar as xgr

from pagedllm.core.step_plan import NewSequence
from pagedllm.structured.utf8 import BOUNDARY, Utf8Guard, Utf8State, after

log = logging.getLogger(__name__)


@dataclass
class TokenMask:
    """The tokens each constrained row of a batch may take: xgrammar's packed bitmask (one
    bit per token id, set when allowed) and the rows it applies to."""

    bitmask: torch.Tensor
    rows: list[int]

    def apply(self, logits: torch.Tensor) -> None:
        """Set the disallowed tokens' logits of the constrained rows to -inf, all at once."""
        xgr.apply_token_bitmask_inplace(
            logits, self.bitmask.to(logits.device, non_blocking=True), indices=self.rows
        )


@dataclass
class _Matcher:
    matcher: xgr.GrammarMatcher
    # Output tokens accepted so far.
    consumed: int = 0
    # A token the grammar refused: the sequence goes on unconstrained.
    broken: bool = False
    # Where the output's bytes stand in a UTF-8 character (see structured.utf8).
    utf8: Utf8State = BOUNDARY


class GrammarMatchers:
    def __init__(self, info: xgr.TokenizerInfo) -> None:
        self.info = info
        self.utf8 = Utf8Guard([bytes(t) for t in info.decoded_vocab], info.vocab_size)
        self.grammars: dict[str, xgr.CompiledGrammar] = {}
        self._matchers: dict[int, _Matcher] = {}
        self._bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
        # One thread: masks are filled one step at a time, in order.
        self._filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self._filling: Future[TokenMask | None] | None = None

    def load(self, grammars: dict[str, str]) -> str | None:
        """Take in the plan's new grammars; what is wrong with one, or None."""
        self._settle()
        for key, data in grammars.items():
            if key in self.grammars:  # keys name their content
                continue
            try:
                self.grammars[key] = xgr.CompiledGrammar.deserialize_json(data, self.info)
            except Exception as error:  # a grammar compiled for another vocabulary, or junk
                return f"grammar {key} cannot be loaded: {error}"
        return None

    def drop_grammars(self, keys: Iterable[str]) -> None:
        self._settle()
        for key in keys:
            self.grammars.pop(key, None)

    def forget(self, seq_ids: Iterable[int]) -> None:
        self._settle()
        for seq_id in seq_ids:
            self._matchers.pop(seq_id, None)

    def mask_ahead(self, seqs: list[tuple[int, NewSequence]]) -> Future[TokenMask | None]:
        """``mask`` on the filling thread, so that it runs alongside the model; the caller
        touches no matcher and no sequence's tokens until the future is done (the next
        plan's ``forget`` waits for it, should a failed step have left it running)."""
        self._settle()
        if all(seq.sampling.grammar_key is None for _, seq in seqs):
            none: Future[TokenMask | None] = Future()
            none.set_result(None)  # no thread hop for a batch without constraints
            return none
        self._filling = self._filler.submit(self.mask, seqs)
        return self._filling

    def _settle(self) -> None:
        """Wait for a mask still being filled (its result or error belong to its step)."""
        if self._filling is not None:
            wait([self._filling])
            self._filling = None

    def mask(self, seqs: list[tuple[int, NewSequence]]) -> TokenMask | None:
        """The bitmask of the batch sampling ``seqs`` (in row order), or None when none of
        them is constrained."""
        rows = [i for i, (_, seq) in enumerate(seqs) if seq.sampling.grammar_key is not None]
        if not rows:
            return None
        if self._bitmask.shape[0] < len(seqs):
            self._bitmask = xgr.allocate_token_bitmask(len(seqs), self.info.vocab_size)
        filled = []
        for i in rows:
            seq_id, seq = seqs[i]
            state = self._advance(seq_id, seq)
            # A grammar that took its end token has a sequence the scheduler is ending: a
            # step planned ahead still samples it, and that sample is dropped.
            if not state.broken and not state.matcher.is_terminated():
                state.matcher.fill_next_token_bitmask(self._bitmask, i)
                self._bitmask[i] &= self.utf8.packed(state.utf8)
                filled.append(i)
        return TokenMask(self._bitmask[: len(seqs)], filled) if filled else None

    def _advance(self, seq_id: int, seq: NewSequence) -> _Matcher:
        state = self._matchers.get(seq_id)
        if state is None:
            key = seq.sampling.grammar_key
            assert key is not None
            state = self._matchers[seq_id] = _Matcher(xgr.GrammarMatcher(self.grammars[key]))
        outputs = seq.token_ids[seq.prompt_len :]
        for token in outputs[state.consumed :]:
            if not state.broken and not state.matcher.accept_token(token):
                log.warning(
                    "sequence %d: the grammar refused token %d; the rest is unconstrained",
                    seq_id,
                    token,
                )
                state.broken = True
            if token < len(self.utf8.token_bytes):
                # Past a malformed byte (unconstrained output), start again at the next token.
                state.utf8 = after(state.utf8, self.utf8.token_bytes[token]) or BOUNDARY
        state.consumed = len(outputs)
        return state
