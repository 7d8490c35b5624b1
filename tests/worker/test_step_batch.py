"""The step's batch as the runner lays it out: rows per sequence, the cache slots written, and
which rows are sampled, verify drafts or give prompt logprobs. Numpy only, no model."""

from __future__ import annotations

import numpy as np

from pagedllm.core.step_plan import NewSequence, SamplingSpec, StepPlan
from pagedllm.worker.step_batch import PromptRows, Verifying, prepare_batch


def sequence(seq_id: int, tokens: list[int], computed: int, **sampling: int) -> NewSequence:
    return NewSequence(seq_id, tokens, 4, [7, 3], computed, computed, SamplingSpec(**sampling))


def test_a_prefill_a_decode_with_a_draft_and_a_chunk_take_their_rows() -> None:
    prefill = sequence(0, [1, 2, 3, 4], 0, prompt_logprobs=2)
    decoding = sequence(1, [1, 2, 3, 4, 5], 4)
    chunk = sequence(2, [1, 2, 3, 4, 5, 6], 0)
    seqs = {0: prefill, 1: decoding, 2: chunk}
    plan = StepPlan(0, scheduled=[(0, 4), (1, 3), (2, 3)], drafts={1: [8, 9]})
    batch = prepare_batch(plan, seqs, block_size=4)
    assert batch.cu_seqlens == [0, 4, 7, 10]
    assert [ids.tolist() for ids in batch.input_ids] == [[1, 2, 3, 4], [5, 8, 9], [1, 2, 3]]
    # Block 7 holds positions 0-3, block 3 positions 4-7.
    assert [slot.tolist() for slot in batch.slots] == [[28, 29, 30, 31], [12, 13, 14], [28, 29, 30]]
    assert batch.seq_lens == [4, 7, 3]
    assert batch.block_table().tolist() == [[7, 3]] * 3
    # The prefill samples from its last row; the chunk is not done; the draft is verified.
    assert batch.sampled == [(0, prefill)] and batch.sample_rows == [3]
    assert batch.verifying == [Verifying(1, decoding, 4, [8, 9])]
    assert batch.prompt_rows == [PromptRows(0, prefill, 0, 0, 3)]
    # The drafts are not the sequence's yet.
    assert (decoding.num_computed_tokens, decoding.num_kv_tokens) == (5, 5)
    assert (chunk.num_computed_tokens, prefill.num_computed_tokens) == (3, 4)


def test_slots_already_in_the_cache_are_not_written_again() -> None:
    seq = sequence(0, [1, 2, 3, 4, 5], 2)
    seq.num_kv_tokens = 4  # written by a step whose tokens were dropped (a rejected draft)
    batch = prepare_batch(StepPlan(0, scheduled=[(0, 3)]), {0: seq}, block_size=4)
    assert batch.slots[0].tolist() == [-1, -1, 12]
    assert np.array_equal(batch.positions[0], [2, 3, 4])
