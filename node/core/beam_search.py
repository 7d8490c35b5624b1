"""Beam search over a request's sequences.

Each step the workers return, for every live beam, its most likely next tokens. Once every
live beam of a request has its candidates, the ``beam_width`` best continuations (by
cumulative log probability) go on, branching a beam where it has several; a continuation that
ends on an eos becomes a finished hypothesis instead. The search ends when ``beam_width``
hypotheses are finished or no beam is left.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedllm.core.sequence import FinishReason, Request, Sequence, SequenceStatus

# Per live beam (by seq id), the (token, logprob) continuations it goes on with, best first.
Picks = dict[int, list[tuple[int, float]]]


class BeamSearch:
    """Beam selection; what it does to sequences, the scheduler does for it."""

    def __init__(
        self,
        finish: Callable[[Sequence, FinishReason], None],
        fork: Callable[[Sequence], Sequence],
        extend: Callable[[Sequence, int, float], None],
        new_seq_id: Callable[[], int],
    ) -> None:
        self._finish = finish
        self._fork = fork
        self._extend = extend
        self._new_seq_id = new_seq_id

    def settle(self, running: list[Sequence]) -> list[Request]:
        """Select for searches whose unfinished beams were preempted since their candidates
        came in; the requests whose search that ended."""
        pending = {
            s.request.request_id: s.request for s in running if s.beam_candidates is not None
        }
        ended = []
        for request in pending.values():
            self.step(request)
            if not request.seqs:
                ended.append(request)
        return ended

    def step(self, request: Request) -> None:
        """Select the next beams once every live beam has its candidates."""
        live = [s for s in request.seqs if s.status == SequenceStatus.RUNNING]
        if not live or any(s.beam_candidates is None for s in live):
            return
        # A beam preempted for memory drops out of the search rather than stall it.
        for seq in request.seqs:
            if seq.status == SequenceStatus.WAITING:
                self._finish(seq, FinishReason.ABORT)
        picks = self._choose(request, live)
        for seq in live:
            seq.beam_candidates = None
        request.seqs = self._advance(live, picks)
        self._end_if_over(request)

    def _choose(self, request: Request, live: list[Sequence]) -> Picks:
        """The best continuations; those ending on an eos are kept as finished hypotheses."""
        p = request.params
        ranked = sorted(
            (
                (s.cumulative_logprob + lp, s, tok, lp)
                for s in live
                for tok, lp in s.beam_candidates or ()
            ),
            key=lambda c: -c[0],
        )
        picks: Picks = {}
        num_chosen = 0
        for _, seq, tok, lp in ranked:
            if num_chosen == p.beam_width:
                break
            is_eos = not p.ignore_eos and tok in request.eos_token_ids
            if is_eos and seq.num_output_tokens + 1 > p.min_tokens:
                if len(request.finished_beams) < p.beam_width:
                    request.finished_beams.append(self._hypothesis(seq, tok, lp))
                continue
            picks.setdefault(seq.seq_id, []).append((tok, lp))
            num_chosen += 1
        return picks

    def _hypothesis(self, seq: Sequence, token: int, logprob: float) -> Sequence:
        return Sequence(
            self._new_seq_id(),
            seq.request,
            seq.token_ids + [token],
            status=SequenceStatus.FINISHED,
            finish_reason=FinishReason.STOP,
            cumulative_logprob=seq.cumulative_logprob + logprob,
        )

    def _advance(self, live: list[Sequence], picks: Picks) -> list[Sequence]:
        """Extend each beam by its picks (branching for the second on); the beams now."""
        beams: list[Sequence] = []
        for seq in live:
            chosen = picks.get(seq.seq_id, [])
            if not chosen:
                self._finish(seq, FinishReason.ABORT)
                continue
            branches = [self._fork(seq) for _ in chosen[1:]]
            for target, (tok, lp) in zip([seq, *branches], chosen, strict=True):
                self._extend(target, tok, lp)
                beams.append(target)
        return beams

    def _end_if_over(self, request: Request) -> None:
        beams = request.seqs
        search_over = len(request.finished_beams) >= request.params.beam_width or not beams
        if search_over or all(s.is_finished for s in beams):
            for seq in beams:
                if not seq.is_finished:
                    self._finish(seq, FinishReason.LENGTH)
            request.finished_beams.extend(beams)
            request.seqs = []
