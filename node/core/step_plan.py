"""What the scheduler tells the workers each step, and what they answer.

A plan is a difference against what the workers already know: new sequences travel in full,
running ones only with their new tokens, new block ids and computed-token counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.core.lora_request import LoRARequest


@dataclass
class SamplingSpec:
    """The part of a request's sampling settings a worker needs."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    # Token ids that may not be sampled before min_tokens outputs (eos and stop tokens).
    min_tokens_blocked: list[int] = field(default_factory=list)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # > 0: return the 2 * beam_width most likely tokens instead of sampling.
    beam_width: int = 0
    # The compiled grammar (of StepPlan.grammars) the outputs must follow, by its key.
    grammar_key: str | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None
    # Token sequences never to complete: the last token is blocked after the others.
    bad_words_ids: list[list[int]] = field(default_factory=list)


@dataclass
class NewSequence:
    seq_id: int
    token_ids: list[int]
    prompt_len: int
    block_ids: list[int]
    num_computed_tokens: int
    num_kv_tokens: int
    sampling: SamplingSpec
    # The LoRA adapter the sequence runs with; a worker loads it from the path on first use.
    lora: LoRARequest | None = None


# In ``RunningUpdate.new_token_ids``: the token the worker itself sampled for the sequence in
# the step before (async scheduling: the plan was made before that sample reached the
# scheduler).
LAST_SAMPLE = -1


@dataclass
class RunningUpdate:
    seq_id: int
    new_token_ids: list[int]
    # The block table from index ``blocks_from`` on is replaced by ``block_ids``.
    blocks_from: int
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class StepPlan:
    step_id: int
    new: list[NewSequence] = field(default_factory=list)
    running: list[RunningUpdate] = field(default_factory=list)
    # (seq_id, tokens to compute) in batch order.
    scheduled: list[tuple[int, int]] = field(default_factory=list)
    # Sequences that draw more than one sample this step (n > 1 fan-out), by seq_id.
    num_samples: dict[int, int] = field(default_factory=dict)
    finished: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Compiled grammars the workers do not hold yet (key -> data), and those they may drop.
    grammars: dict[str, str] = field(default_factory=dict)
    dropped_grammars: list[str] = field(default_factory=list)
    # Speculative decoding: seq_id -> draft tokens, the last of the sequence's scheduled
    # tokens (after all its known ones). The workers verify them and answer with the accepted
    # drafts plus one token of their own in the sample.
    drafts: dict[int, list[int]] = field(default_factory=dict)
    # The scheduler's adapter LRU (core.adapter_lru) decides what the workers hold: they drop
    # these adapters (by LoRARequest.key), then load these, before the step runs.
    lora_drops: list[tuple[str, str]] = field(default_factory=list)
    lora_loads: list[LoRARequest] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Nothing for the workers to do or to change."""
        return not (
            self.scheduled
            or self.new
            or self.running
            or self.finished
            or self.block_copies
            or self.grammars
            or self.dropped_grammars
            or self.lora_drops
            or self.lora_loads
        )


@dataclass
class SeqSample:
    seq_id: int
    token_ids: list[int]
    logprobs: list[float]
    # Per sampled token, the top-k (token, logprob) pairs when logprobs were asked for.
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class PromptLogprobs:
    seq_id: int
    # Position (in the prompt) of the first token these log probabilities are for.
    start: int
    token_logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]


@dataclass
class StepResult:
    step_id: int
    samples: list[SeqSample] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
