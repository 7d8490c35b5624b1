"""A request and its sequences, as the scheduler tracks them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedllm.core.lora_request import LoRARequest
from pagedllm.core.request_delta import RequestTimings
from pagedllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, a stop token or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # the client went away or the request was cancelled
    ERROR = "error"  # the request can never be served (e.g. longer than the cache)


@dataclass
class BlockTable:
    """A sequence's KV-cache blocks; only the block manager changes it."""

    ids: list[int] = field(default_factory=list)
    # Content hashes of the sequence's full blocks, extended as tokens arrive.
    hashes: list[bytes] = field(default_factory=list)
    # How many leading blocks are published in the prefix cache.
    num_registered: int = 0


@dataclass
class Sequence:
    """One stream of tokens with its own block table.

    ``num_computed_tokens`` counts tokens whose forward pass is done; ``num_kv_tokens`` counts
    tokens whose K/V is in the cache. They differ only after a prefix-cache hit on a prompt
    that is an exact multiple of the block size: the last token is run again for its logits
    but its K/V is already there. What the workers hold of it is the ``WorkerView``'s.
    """

    seq_id: int
    request: Request
    token_ids: list[int]
    index: int = 0
    seed: int | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_kv_tokens: int = 0
    blocks: BlockTable = field(default_factory=BlockTable)
    cumulative_logprob: float = 0.0
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # Async scheduling: the last token is a LAST_SAMPLE placeholder for the sample of the step
    # in flight, scheduled before that step's results came back.
    pending_sample: bool = False
    # Beam search: candidates (token, logprob) sampled but not yet chosen.
    beam_candidates: list[tuple[int, float]] | None = None
    # Speculative decoding: steps left before the sequence drafts again, and how many draft
    # attempts in a row gained nothing (the pause doubles with each).
    spec_pause: int = 0
    spec_misses: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_len(self) -> int:
        return self.request.prompt_len

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def params(self) -> SamplingParams:
        return self.request.params


@dataclass(frozen=True)
class GrammarRef:
    """A request's compiled output constraint: ``key`` names it (equal constraints share it),
    ``data`` is the compiled grammar in the form the workers load, opaque here."""

    key: str
    data: str


@dataclass
class Request:
    """A user request: a prompt, its sampling settings and the sequences generated for it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    timings: RequestTimings
    seqs: list[Sequence] = field(default_factory=list)
    # Beam search keeps finished hypotheses here until the search ends.
    finished_beams: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    error: str | None = None
    grammar: GrammarRef | None = None
    # The LoRA adapter the request runs with (None: the base model).
    lora: LoRARequest | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
