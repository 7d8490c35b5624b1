"""The batch of one step, laid out from a plan: the model's input rows of every scheduled
sequence, and which rows are read afterwards (sampled, verifying drafts, prompt logprobs).
Numpy only; the runner turns it into tensors and attention metadata."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagedllm.core.step_plan import NewSequence, StepPlan


@dataclass
class Verifying:
    """A sequence whose drafts are verified: the logits of rows ``first_row`` ..
    ``first_row + len(draft)`` (the last known token's and each draft token's)."""

    seq_id: int
    seq: NewSequence
    first_row: int
    draft: list[int]


@dataclass
class PromptRows:
    """The rows ``row .. row + count - 1`` give the logprobs of the prompt tokens after
    positions ``start .. start + count - 1``."""

    seq_id: int
    seq: NewSequence
    row: int
    start: int
    count: int


@dataclass
class StepBatch:
    # Per scheduled sequence, in the plan's order: its input tokens, their positions and the
    # cache slots their K/V go to (-1: already written).
    input_ids: list[np.ndarray] = field(default_factory=list)
    positions: list[np.ndarray] = field(default_factory=list)
    slots: list[np.ndarray] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    # Row where each sequence starts, and the end: len = sequences + 1.
    cu_seqlens: list[int] = field(default_factory=lambda: [0])
    seq_lens: list[int] = field(default_factory=list)  # tokens in the cache after the step
    # The sequences sampled, and the row whose logits each one samples from.
    sampled: list[tuple[int, NewSequence]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    verifying: list[Verifying] = field(default_factory=list)
    prompt_rows: list[PromptRows] = field(default_factory=list)

    def block_table(self) -> np.ndarray:
        """The sequences' block tables, padded with zeros to the longest."""
        table = np.zeros((len(self.tables), max(len(t) for t in self.tables)), dtype=np.int32)
        for i, blocks in enumerate(self.tables):
            table[i, : len(blocks)] = blocks
        return table


def prepare_batch(plan: StepPlan, seqs: dict[int, NewSequence], block_size: int) -> StepBatch:
    """The batch of ``plan``'s scheduled sequences (``seqs``: the worker's copies, whose
    computed and cached token counts move on to the end of this step)."""
    batch = StepBatch()
    for seq_id, n in plan.scheduled:
        _add_sequence(batch, seq_id, seqs[seq_id], n, plan.drafts.get(seq_id, []), block_size)
    return batch


def _add_sequence(
    batch: StepBatch, seq_id: int, seq: NewSequence, n: int, draft: list[int], block_size: int
) -> None:
    start = seq.num_computed_tokens
    # The drafts run after the known tokens, through the same paged attention: one
    # multi-token step of the sequence against its cache, like a prefill chunk.
    known = n - len(draft)
    pos = np.arange(start, start + n)
    table = np.asarray(seq.block_ids, dtype=np.int64)
    slot = table[pos // block_size] * block_size + pos % block_size
    slot[pos < seq.num_kv_tokens] = -1
    batch.input_ids.append(np.asarray(seq.token_ids[start : start + known] + draft, dtype=np.int64))
    batch.positions.append(pos)
    batch.slots.append(slot)
    row0 = batch.cu_seqlens[-1]
    batch.cu_seqlens.append(row0 + n)
    batch.seq_lens.append(start + n)
    batch.tables.append(seq.block_ids)
    if seq.sampling.prompt_logprobs is not None and start < seq.prompt_len - 1:
        count = min(start + n, seq.prompt_len - 1) - start
        batch.prompt_rows.append(PromptRows(seq_id, seq, row0, start, count))
    # Drafts are not the sequence's tokens (yet): the scheduler sends those accepted, and
    # their K/V slots count as unwritten until then.
    seq.num_computed_tokens = start + known
    seq.num_kv_tokens = max(seq.num_kv_tokens, start + known)
    if draft:
        batch.verifying.append(Verifying(seq_id, seq, row0 + known - 1, draft))
    elif start + n == len(seq.token_ids):
        batch.sample_rows.append(row0 + n - 1)
        batch.sampled.append((seq_id, seq))
