"""Block accounting under random operation sequences, and the sharing it promises."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.request_delta import RequestTimings
from pagedllm.core.sequence import Request, Sequence
from pagedllm.core.speculative import SpeculativeConfig
from pagedllm.sampling_params import SamplingParams
from pagedllm_testing.scheduler_machine import (
    SchedulerMachine,
)

TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


class SpeculativeSchedulerMachine(SchedulerMachine):
    """The same, with n-gram drafts (prompts of 5 token values repeat) accepted up to random
    positions: the KV slots of rejected drafts go back and the accounting still holds."""

    speculative = SpeculativeConfig(
        num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1
    )


TestSpeculativeSchedulerMachine = SpeculativeSchedulerMachine.TestCase
TestSpeculativeSchedulerMachine.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None
)


def _request(prompt: list[int], params: SamplingParams) -> Request:
    return Request("r", prompt, params, (), RequestTimings(0.0))


def test_prefix_hit_reuses_blocks_and_recomputes_only_last_token() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(1, 9))  # exactly two blocks
    first = Sequence(0, _request(prompt, SamplingParams()), list(prompt))
    assert bm.allocate(first, len(prompt), bm.find_prefix(first))
    first.num_computed_tokens = first.num_kv_tokens = len(prompt)
    bm.register_computed(first)
    second = Sequence(1, _request(prompt, SamplingParams()), list(prompt))
    hit = bm.find_prefix(second)
    assert hit.block_ids == first.blocks.ids
    assert bm.allocate(second, 1, hit)
    assert second.blocks.ids == first.blocks.ids
    assert second.num_computed_tokens == 7 and second.num_kv_tokens == 8
    assert bm.pool.num_used == 2
    assert bm.prefix_hits == 8 and bm.prefix_queries == 16
    assert [bm.pool.blocks[b].reuses for b in hit.block_ids] == [1, 1]
    assert bm.pool.num_shared == 2
    bm.free(second)
    assert bm.pool.num_shared == 0
    bm.free(first)
    cached = bm.pool.cached_free()
    assert [b.block_id for b in cached] == list(reversed(hit.block_ids))  # tail first
    assert [b.reuses for b in cached] == [1, 1]


def test_freed_blocks_keep_hash_until_reused_tail_first() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    seq = Sequence(0, _request([1, 2, 3, 4], SamplingParams()), [1, 2, 3, 4])
    assert bm.allocate(seq, 4, bm.find_prefix(seq))
    head, tail = seq.blocks.ids
    seq.num_computed_tokens = seq.num_kv_tokens = 4
    bm.register_computed(seq)
    bm.free(seq)
    # The tail is evicted before the head, after the never-used block.
    assert [bm.pool.allocate() for _ in range(2)] == [2, tail]
    again = Sequence(1, _request([1, 2, 3, 4], SamplingParams()), [1, 2, 3, 4])
    assert bm.find_prefix(again).block_ids == [head]


def test_fork_shares_and_copy_on_write_copies_partial_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = [1, 2, 3, 4, 5, 6]
    parent = Sequence(0, _request(prompt, SamplingParams()), list(prompt))
    assert bm.allocate(parent, 6, bm.find_prefix(parent))
    parent.num_computed_tokens = parent.num_kv_tokens = 6
    child = Sequence(1, parent.request, list(prompt))
    child.num_computed_tokens = child.num_kv_tokens = 6
    bm.fork(parent, child)
    assert bm.pool.num_used == 2
    child.token_ids.append(9)
    assert bm.allocate(child, 1)
    assert child.blocks.ids[0] == parent.blocks.ids[0]
    assert child.blocks.ids[1] != parent.blocks.ids[1]
    assert bm.take_copies() == [(parent.blocks.ids[1], child.blocks.ids[1])]
    parent.token_ids.append(7)
    assert bm.allocate(parent, 1)  # now the only holder: writes in place
    assert bm.take_copies() == []


@pytest.mark.parametrize("machine_class", [SchedulerMachine, SpeculativeSchedulerMachine])
@pytest.mark.parametrize("block", range(4))
def test_random_traces_drain_completely(block: int, machine_class: type[SchedulerMachine]) -> None:
    # Long random traces (many requests on a tiny cache, beams among them) reach corners
    # such as a beam search whose siblings are preempted between its steps.
    for trial in range(block * 150, (block + 1) * 150):
        rng = random.Random(trial)
        machine = machine_class()
        for _ in range(rng.randint(1, 25)):
            roll = rng.random()
            if roll < 0.5:
                machine.add(
                    prompt=[rng.randint(1, 5) for _ in range(rng.randint(1, 30))],
                    n=rng.randint(1, 3),
                    beam=rng.random() < 0.4,
                    max_tokens=rng.randint(1, 12),
                )
            elif roll < 0.65 and machine.live:
                request_id = rng.choice(sorted(machine.live))
                machine.scheduler.abort(request_id)
                machine.live.discard(request_id)
            else:
                machine.step(rng.randint(1, 6))
            machine.accounting()
        machine.teardown()
