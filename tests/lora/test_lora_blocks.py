"""LoRA adapters and the prefix cache: a block's content is the K/V of its tokens under one
adapter (or the base model), so sequences of different adapters never share a block, and the
block manager's accounting holds with adapters under preemption."""

from __future__ import annotations

from hypothesis import settings
from hypothesis.stateful import invariant

from pagedllm.core.block_manager import chained_hashes, root_hash
from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams
from pagedllm_testing.fake_worker import FakeWorker
from pagedllm_testing.scheduler_machine import SchedulerMachine


def adapter_of(seq) -> str | None:
    return None if seq.request.lora is None else seq.request.lora.lora_name


def two_adapter_scheduler() -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=256,
            max_model_len=64, max_loras=2,
        )
    )  # fmt: skip


class LoRASchedulerMachine(SchedulerMachine):
    """The scheduler machine (tiny cache: preemption, n > 1, beams, aborts) with requests for
    three adapters or none, two adapters a step."""

    adapters = ("a", "b", "c")
    max_loras = 2

    @invariant()
    def adapters_never_share_a_block(self) -> None:
        owner: dict[int, str | None] = {}
        for seq in self.scheduler.running:
            for block in seq.blocks.ids:
                assert owner.setdefault(block, adapter_of(seq)) == adapter_of(seq), block

    @invariant()
    def published_blocks_hash_their_adapter(self) -> None:
        # A sequence's published blocks (its own or found in the cache) carry the hashes of
        # its tokens chained from its adapter's root: another adapter's block never matches.
        pool, bs = self.scheduler.block_manager.pool, self.scheduler.config.block_size
        for seq in self.scheduler.running:
            count = seq.blocks.num_registered
            expected = chained_hashes(
                root_hash(0, None if seq.request.lora is None else seq.request.lora.key),
                seq.token_ids[: count * bs],
                bs,
            )
            assert [pool.blocks[b].content_hash for b in seq.blocks.ids[:count]] == expected

    @invariant()
    def at_most_max_loras_adapters_run(self) -> None:
        running = {adapter_of(s) for s in self.scheduler.running} - {None}
        assert len(running) <= self.max_loras


TestLoRASchedulerMachine = LoRASchedulerMachine.TestCase
TestLoRASchedulerMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)


def test_the_same_prompt_shares_blocks_only_under_the_same_adapter():
    scheduler = two_adapter_scheduler()
    worker = FakeWorker(vocab=6, eos=0)
    prompt = [1, 2, 3, 4] * 4  # four full blocks
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    a = LoRARequest("a", 1, "/adapters/a")
    b = LoRARequest("b", 2, "/adapters/b")
    # The first three run to the end, publishing their blocks; the later three look them up.
    for i, lora in enumerate((None, a, b, None, a, b)):
        scheduler.add_request(f"r{i}", prompt, params, (0,), lora=lora)
        while scheduler.has_work():
            plan = scheduler.schedule()
            scheduler.update(plan, worker.execute(plan))
    # Only the last three found blocks: each its own adapter's four.
    assert scheduler.block_manager.prefix_hits == 3 * 16
    # All six at once: each pair with one adapter shares its blocks, no two adapters do.
    for i, lora in enumerate((None, a, b, None, a, b)):
        scheduler.add_request(f"s{i}", prompt, params, (0,), lora=lora)
    plan = scheduler.schedule()
    tables = {seq.request.request_id: seq.blocks.ids[:4] for seq in scheduler.running}
    assert len(tables) == 6
    for x, y in (("s0", "s3"), ("s1", "s4"), ("s2", "s5")):
        assert tables[x] == tables[y]
    assert len({tuple(tables[k]) for k in ("s0", "s1", "s2")}) == 3
    assert not set(tables["s0"]) & set(tables["s1"]) | set(tables["s0"]) & set(tables["s2"])
    scheduler.update(plan, worker.execute(plan))


def test_a_third_adapter_waits_while_two_run_and_the_base_model_goes_ahead():
    scheduler = two_adapter_scheduler()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for i, name in enumerate(("a", "b", "c", None)):
        lora = None if name is None else LoRARequest(name, i + 1, f"/adapters/{name}")
        scheduler.add_request(f"r{i}", [1, 2, 3], params, (0,), lora=lora)
    scheduler.schedule()
    assert sorted(s.request.request_id for s in scheduler.running) == ["r0", "r1", "r3"]
    assert [s.request.request_id for s in scheduler.waiting] == ["r2"]


def test_a_request_for_an_adapter_is_refused_without_lora():
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=16
        )
    )
    try:
        scheduler.add_request("r", [1], SamplingParams(), lora=LoRARequest("a", 1, "/a"))
    except ValueError as e:
        assert "LoRA is not enabled" in str(e)
    else:
        raise AssertionError("accepted")
