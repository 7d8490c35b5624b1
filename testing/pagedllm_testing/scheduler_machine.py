"""The block manager driven by random requests, aborts and steps (a hypothesis state machine),
and the accounting every state must satisfy."""

from __future__ import annotations

from collections import Counter

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedllm.core.kv_map import take_map, waste_slots
from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from pagedllm.core.sequence import Sequence, SequenceStatus
from pagedllm.core.speculative import SpeculativeConfig
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams
from pagedllm_testing.fake_worker import FakeWorker


def live_block_tables(scheduler: Scheduler) -> list[list[int]]:
    seqs = [s for s in scheduler.running] + [s for s in scheduler.waiting]
    return [s.blocks.ids for s in seqs]


def check_accounting(scheduler: Scheduler) -> None:
    pool = scheduler.block_manager.pool
    holders = Counter(b for table in live_block_tables(scheduler) for b in table)
    for block in pool.blocks:
        assert block.ref_count == holders.get(block.block_id, 0), block
        assert pool.is_free(block.block_id) == (block.ref_count == 0)
    assert pool.num_free == sum(1 for b in pool.blocks if b.ref_count == 0)
    assert pool.num_shared == sum(1 for b in pool.blocks if b.ref_count > 1)
    check_map(scheduler)
    # A waiting sequence holds nothing; finished ones are gone from both queues.
    for seq in scheduler.waiting:
        assert seq.blocks.ids == [] and seq.status == SequenceStatus.WAITING
    bs = scheduler.config.block_size
    for seq in scheduler.running:
        assert seq.status == SequenceStatus.RUNNING
        assert len(seq.blocks.ids) * bs >= seq.num_kv_tokens
        # Between steps no sequence holds blocks for tokens it does not have (rejected drafts
        # gave theirs back), and only blocks of final, computed tokens are published.
        assert len(seq.blocks.ids) <= -(-seq.num_tokens // bs)
        assert seq.blocks.num_registered * bs <= min(seq.num_kv_tokens, seq.num_tokens)


def check_map(scheduler: Scheduler) -> None:
    """The block map and the waste metric agree with a count over every block held."""
    manager = scheduler.block_manager
    pool, bs = manager.pool, manager.block_size
    filled: dict[int, int] = {}
    for seq in scheduler.running:
        for i, block in enumerate(seq.blocks.ids):
            n = max(0, min(bs, seq.num_kv_tokens - i * bs))
            filled[block] = max(filled.get(block, 0), n)
    assert len(filled) == pool.num_used
    assert waste_slots(scheduler.running, bs) == pool.num_used * bs - sum(filled.values())
    stats = scheduler.stats()
    kv_map = take_map(manager, scheduler.running, stats.num_running, stats.num_waiting)
    assert {b for s in kv_map.seqs for b in s.block_ids} == set(filled)
    assert kv_map.num_used == pool.num_used and kv_map.totals.waste_slots == waste_slots(
        scheduler.running, bs
    )
    shared = {b.block_id: b.ref_count for b in pool.blocks if b.ref_count > 1}
    assert dict(zip(kv_map.shared_ids, kv_map.shared_refs, strict=True)) == shared
    assert stats.kv_shared_blocks == len(shared)
    cached = kv_map.cached_ids
    assert all(pool.is_free(b) for b in cached) and len(set(cached)) == len(cached)
    for b in cached:
        h = pool.blocks[b].content_hash
        assert h is not None and pool.cached_block(h) == b
    holders = [pool.cached_block(h) for h in pool.cached_hashes]
    assert len(cached) == sum(1 for b in holders if b is not None and pool.is_free(b))


class SchedulerMachine(RuleBasedStateMachine):
    """Random requests (n > 1, beams, long prompts), aborts and steps on a tiny cache."""

    speculative: SpeculativeConfig | None = None
    # LoRA adapters a request may name (none: the base model only), and how many a step runs.
    adapters: tuple[str, ...] = ()
    max_loras: int = 0

    def __init__(self) -> None:
        super().__init__()
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=12,
                block_size=4,
                max_num_seqs=6,
                max_num_batched_tokens=16,
                max_model_len=40,
                enable_prefix_caching=True,
                speculative=self.speculative,
                max_loras=self.max_loras,
            )
        )
        self.worker = FakeWorker(vocab=6, eos=0)
        self.next_id = 0
        self.live: set[str] = set()
        self.finished: set[str] = set()
        self.ran: dict[int, Sequence] = {}  # every sequence scheduled so far, by id

    @rule(
        prompt=st.lists(st.integers(1, 5), min_size=1, max_size=30),
        n=st.integers(1, 3),
        beam=st.booleans(),
        max_tokens=st.integers(1, 12),
        adapter=st.integers(0, 3),
    )
    def add(
        self, prompt: list[int], n: int, beam: bool, max_tokens: int, adapter: int | None = None
    ) -> None:
        params = (
            SamplingParams(
                n=n, best_of=n, use_beam_search=True, temperature=0.0, max_tokens=max_tokens
            )
            if beam and n > 1
            else SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True)
        )
        request_id = f"r{self.next_id}"
        self.next_id += 1
        lora = (
            LoRARequest(self.adapters[adapter], adapter + 1, f"/adapters/{self.adapters[adapter]}")
            if adapter is not None and adapter < len(self.adapters)
            else None
        )
        self.scheduler.add_request(request_id, prompt, params, eos_token_ids=(0,), lora=lora)
        self.live.add(request_id)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        self.scheduler.abort(request_id)
        self.live.discard(request_id)

    @rule(steps=st.integers(1, 6))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            plan = self.scheduler.schedule()
            self.ran.update((s.seq_id, s) for s in self.scheduler.running)
            result = self.worker.execute(plan)
            for delta in self.scheduler.update(plan, result):
                if delta.finished:
                    assert delta.request_id not in self.finished
                    self.finished.add(delta.request_id)
                    self.live.discard(delta.request_id)

    @invariant()
    def accounting(self) -> None:
        check_accounting(self.scheduler)

    def teardown(self) -> None:
        # Whatever happened, draining the queue must end every request and free every block.
        for _ in range(2000):
            if not self.scheduler.has_work():
                break
            self.step(1)
        assert not self.scheduler.has_work()
        assert not self.live
        assert self.scheduler.block_manager.pool.num_free == 12
