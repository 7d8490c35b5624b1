"""A stand-in worker for scheduler tests: samples tokens without a model."""

from __future__ import annotations

import random

from pagedllm.core.step_plan import SeqSample, StepPlan, StepResult


class FakeWorker:
    """Tracks what the plans tell it and answers with random tokens.

    It checks the plan's difference protocol: a running update for an unknown sequence, or a
    computed-token count that disagrees with what it knows, fails the test. Drafts are
    accepted up to a random position.
    """

    def __init__(self, vocab: int = 50, seed: int = 0, eos: int | None = None) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.eos = eos
        self.seqs: dict[int, dict] = {}
        self.copies: list[tuple[int, int]] = []

    def execute(self, plan: StepPlan) -> StepResult:
        for seq_id in plan.finished:
            self.seqs.pop(seq_id, None)
        for new in plan.new:
            assert new.seq_id not in self.seqs
            self.seqs[new.seq_id] = {
                "tokens": list(new.token_ids),
                "blocks": list(new.block_ids),
                "computed": new.num_computed_tokens,
                "beam": new.sampling.beam_width,
            }
        for up in plan.running:
            seq = self.seqs[up.seq_id]
            assert seq["computed"] == up.num_computed_tokens
            seq["tokens"].extend(up.new_token_ids)
            del seq["blocks"][up.blocks_from :]
            seq["blocks"].extend(up.block_ids)
        self.copies.extend(plan.block_copies)
        result = StepResult(plan.step_id)
        for seq_id, n in plan.scheduled:
            seq = self.seqs[seq_id]
            draft = plan.drafts.get(seq_id)
            if draft:
                # A random agreeing prefix of the draft, then a token of its own; the accepted
                # drafts' K/V counts as computed, as the scheduler counts it.
                assert seq["computed"] + n - len(draft) == len(seq["tokens"])
                accepted = self.rng.randint(0, len(draft))
                tokens = draft[:accepted] + [self.rng.randrange(self.vocab)]
                seq["computed"] += n - len(draft) + accepted
                logprobs = [-self.rng.random() * 3 for _ in tokens]
                result.samples.append(SeqSample(seq_id, tokens, logprobs))
                continue
            seq["computed"] += n
            assert seq["computed"] <= len(seq["tokens"])
            if seq["computed"] == len(seq["tokens"]):
                k = 2 * seq["beam"] if seq["beam"] else plan.num_samples.get(seq_id, 1)
                tokens = [self.rng.randrange(self.vocab) for _ in range(k)]
                logprobs = [-self.rng.random() * 3 for _ in range(k)]
                result.samples.append(SeqSample(seq_id, tokens, logprobs))
        return result
