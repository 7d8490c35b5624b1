"""Async scheduling: the plan of step N+1 made before step N's samples are back gives every
request the tokens the synchronous order gives it.

Both orders drive the same scheduler and model runner as the node's scheduler process does
(plans executed by the runner strictly in the order they are sent), on random traces with a
small KV cache (preemption), chunked prefill, prefix caching, n>1, stop tokens, seeded
sampling, logprobs and aborts that land while a placeholder is out.
"""

from __future__ import annotations

import dataclasses
import random
from collections import defaultdict, deque
from dataclasses import dataclass, field

import pytest
import torch

from pagedllm.config import EngineConfig, scheduler_config
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.speculative import SpeculativeConfig
from pagedllm.core.step_pipeline import StepPipeline
from pagedllm.core.step_plan import (
    LAST_SAMPLE,
    NewSequence,
    RunningUpdate,
    SamplingSpec,
    StepPlan,
    StepResult,
)
from pagedllm.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.plan_check import plan_problem

BLOCK_SIZE = 16
NUM_BLOCKS = 24


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    torch.manual_seed(0)
    config = EngineConfig(
        kv_cache_memory=16 << 20, max_num_batched_tokens=64, max_num_seqs=12, block_size=BLOCK_SIZE
    )
    return LLMEngine(config)


@dataclass
class Trace:
    requests: list[tuple[str, list[int], SamplingParams]]
    aborts: dict[int, str]  # step -> request aborted between planning ahead and the update


@dataclass
class Run:
    tokens: dict[tuple[str, int], list[int]] = field(default_factory=lambda: defaultdict(list))
    finish: dict[tuple[str, int], str | None] = field(default_factory=dict)
    placeholders: int = 0
    preemptions: int = 0
    # Sequences preempted or ended while their placeholder was out.
    dropped_in_flight: int = 0
    accepted: int = 0  # draft tokens accepted (speculative decoding)


def random_trace(seed: int, vocab: int) -> Trace:
    rng = random.Random(seed)
    requests = []
    for i in range(14):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 70))]
        n = 2 if rng.random() < 0.25 else 1
        sampled = n > 1 or rng.random() < 0.4
        params = SamplingParams(
            max_tokens=rng.randint(1, 64),
            temperature=0.9 if sampled else 0.0,
            seed=rng.randrange(1000) if sampled else None,
            n=n,
            ignore_eos=rng.random() < 0.7,
            stop_token_ids=[rng.randrange(vocab) for _ in range(3)] if rng.random() < 0.3 else None,
            logprobs=2 if rng.random() < 0.2 else None,
            min_tokens=rng.choice((0, 0, 3)),
            repetition_penalty=rng.choice((1.0, 1.2)),
        )
        requests.append((f"r{i}", prompt, params))
    aborts = {rng.randint(3, 60): f"r{rng.randrange(14)}" for _ in range(2)}
    return Trace(requests, aborts)


class WatchedScheduler(Scheduler):
    """Counts the sequences preempted or ended while a placeholder of theirs was out."""

    dropped_in_flight = 0

    def _preempt(self, seq):
        self.dropped_in_flight += seq.pending_sample
        super()._preempt(seq)

    def _finish(self, seq, reason, stop_reason=None):
        self.dropped_in_flight += seq.pending_sample
        super()._finish(seq, reason, stop_reason)


def drive(
    engine: LLMEngine, trace: Trace, ahead: bool, speculative: SpeculativeConfig | None = None
) -> Run:
    runner = engine.runner
    assert runner.num_blocks >= NUM_BLOCKS
    runner.seqs.clear()
    runner.last_samples.clear()
    config = scheduler_config(engine.config, NUM_BLOCKS, engine.max_model_len)
    scheduler = WatchedScheduler(dataclasses.replace(config, speculative=speculative))
    for request_id, prompt, params in trace.requests:
        scheduler.add_request(request_id, prompt, params, engine.eos_token_ids, 0.0)
    run = Run()
    sent: deque[StepPlan] = deque()
    results: dict[int, StepResult] = {}

    def send(plan: StepPlan) -> None:
        run.placeholders += sum(u.new_token_ids.count(LAST_SAMPLE) for u in plan.running)
        sent.append(plan)

    def result_of(plan: StepPlan) -> StepResult:
        while plan.step_id not in results:  # the worker: in order, each plan checked first
            step = sent.popleft()
            problem = plan_problem(
                step,
                runner.seqs,
                NUM_BLOCKS,
                BLOCK_SIZE,
                runner.model_config.vocab_size,
                runner.last_samples,
            )
            assert problem is None, problem
            results[step.step_id] = runner.execute(step)
        return results.pop(plan.step_id)

    # The scheduler process's order, with the model runner in place of the workers.
    pipeline = StepPipeline(scheduler, send, plan_ahead=ahead)
    steps = 0

    def result_with_aborts(plan: StepPlan) -> StepResult:
        if steps in trace.aborts:  # an abort lands while the step is out
            scheduler.abort(trace.aborts[steps])
        return result_of(plan)

    while scheduler.has_work() or not pipeline.idle:
        pipeline.send_next()
        steps += 1
        for delta in pipeline.complete(result_with_aborts):
            for seq in delta.seqs:
                key = (delta.request_id, seq.index)
                run.tokens[key] += seq.new_token_ids
                if seq.finish_reason is not None:
                    run.finish[key] = seq.finish_reason
        assert steps < 5000, "the trace does not end"
    assert not any(s.pending_sample for s in scheduler.running)
    assert scheduler.block_manager.usage == 0.0, "blocks left held at the end"
    run.preemptions = scheduler.num_preemptions
    run.accepted = scheduler.spec_stats.num_accepted_tokens
    run.dropped_in_flight = scheduler.dropped_in_flight
    return run


@pytest.mark.parametrize("seed", range(4))
def test_planning_ahead_gives_the_tokens_of_the_synchronous_order(engine: LLMEngine, seed: int):
    trace = random_trace(seed, engine.runner.model_config.vocab_size)
    sync = drive(engine, trace, ahead=False)
    async_ = drive(engine, trace, ahead=True)
    assert sync.placeholders == 0
    assert async_.placeholders > 50, "planning ahead never used a placeholder"
    aborted = set(trace.aborts.values())
    kept = [key for key in sync.tokens if key[0] not in aborted]
    assert kept
    for key in kept:
        assert async_.tokens[key] == sync.tokens[key], key
        assert async_.finish.get(key) == sync.finish.get(key), key
    assert set(async_.tokens) >= set(kept)


@pytest.mark.parametrize("seed", range(2))
def test_speculation_within_planning_ahead_gives_the_same_greedy_tokens(
    engine: LLMEngine, seed: int
):
    """Speculating sequences make the node schedule synchronously, the others plan ahead:
    greedy requests (penalties, stop tokens, min_tokens, preemption, aborts among them) get
    the tokens they get without speculation; sampled ones only need to end."""
    trace = random_trace(seed, engine.runner.model_config.vocab_size)
    plain = drive(engine, trace, ahead=True)
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
    speculating = drive(engine, trace, ahead=True, speculative=spec)
    assert speculating.accepted > 0
    aborted = set(trace.aborts.values())
    greedy = {request_id for request_id, _, p in trace.requests if p.temperature == 0}
    kept = [key for key in plain.tokens if key[0] in greedy - aborted]
    assert kept
    for key in kept:
        assert speculating.tokens[key] == plain.tokens[key], key
        assert speculating.finish.get(key) == plain.finish.get(key), key
    assert set(speculating.finish) >= {k for k in plain.finish if k[0] not in aborted}


def test_the_traces_reach_preemption_and_aborts_with_a_sample_in_flight(engine: LLMEngine):
    runs = [
        drive(engine, random_trace(seed, engine.runner.model_config.vocab_size), True)
        for seed in range(4)
    ]
    assert sum(run.preemptions for run in runs) > 0
    assert sum(run.dropped_in_flight for run in runs) > 0


def held_sequence() -> NewSequence:
    """Sequence 7 as a worker holds it: a three-token prompt computed, in block 0."""
    return NewSequence(
        seq_id=7,
        token_ids=[1, 2, 3],
        prompt_len=3,
        block_ids=[0],
        num_computed_tokens=3,
        num_kv_tokens=3,
        sampling=SamplingSpec(),
    )


def test_a_placeholder_needs_a_sample_of_the_workers():
    seqs = {7: held_sequence()}
    plan = StepPlan(
        step_id=1, running=[RunningUpdate(7, [LAST_SAMPLE], 1, [], 3)], scheduled=[(7, 1)]
    )
    assert plan_problem(plan, seqs, 4, BLOCK_SIZE, 100, last_sampled={7}) is None
    problem = plan_problem(plan, seqs, 4, BLOCK_SIZE, 100, last_sampled=set())
    assert problem == "sequence 7: no sample of the worker's to stand in for"
    other = StepPlan(step_id=2, running=[RunningUpdate(7, [-2], 1, [], 3)], scheduled=[(7, 1)])
    assert plan_problem(other, seqs, 4, BLOCK_SIZE, 100, last_sampled={7}) == (
        "token ids outside [0, 100)"
    )


def test_plans_naming_what_the_worker_does_not_hold_are_refused():
    seq = held_sequence()
    seqs = {7: seq}
    fine = StepPlan(step_id=1, running=[RunningUpdate(7, [4], 1, [], 3)], scheduled=[(7, 1)])
    assert plan_problem(fine, seqs, 4, BLOCK_SIZE, 100) is None
    cases = {
        "block ids outside [0, 4)": StepPlan(
            step_id=2, running=[RunningUpdate(7, [4], 1, [4], 3)], scheduled=[(7, 1)]
        ),
        "running update for unknown sequence 8": StepPlan(
            step_id=3, running=[RunningUpdate(8, [4], 0, [], 0)]
        ),
        "scheduled unknown sequence 9": StepPlan(step_id=4, scheduled=[(9, 1)]),
        "sequence 7: cannot compute tokens 3..5": StepPlan(step_id=5, scheduled=[(7, 2)]),
        "token ids outside [0, 100)": StepPlan(
            step_id=6, new=[dataclasses.replace(seq, seq_id=8, token_ids=[1, 100])]
        ),
    }
    for reason, plan in cases.items():
        assert plan_problem(plan, seqs, 4, BLOCK_SIZE, 100) == reason
