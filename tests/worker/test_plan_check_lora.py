"""A worker refuses, whole, a step plan whose LoRA loads and drops disagree with what it holds:
the scheduler's LRU decides, and a mismatch must be loud, not a silent reload."""

from __future__ import annotations

from pagedllm.core.step_plan import NewSequence, SamplingSpec, StepPlan
from pagedllm.lora.request import LoRARequest
from pagedllm.worker.plan_check import plan_problem

SQL = LoRARequest("sql", 1, "/adapters/sql")
LAW = LoRARequest("law", 2, "/adapters/law")


def new(seq_id: int, lora: LoRARequest | None) -> NewSequence:
    return NewSequence(seq_id, [1, 2, 3], 3, [0], 0, 0, SamplingSpec(), lora)


def problem(plan: StepPlan, held: set[tuple[str, str]] | None, capacity: int = 1) -> str | None:
    adapters = None if held is None else (held, capacity)
    return plan_problem(plan, {}, 8, 16, 100, adapters=adapters)


def test_a_step_runs_only_adapters_the_plan_leaves_loaded() -> None:
    runs_sql = StepPlan(0, new=[new(0, SQL)], scheduled=[(0, 3)])
    assert "not loaded" in str(problem(runs_sql, set()))
    assert (
        problem(StepPlan(0, new=[new(0, SQL)], scheduled=[(0, 3)], lora_loads=[SQL]), set()) is None
    )
    assert problem(runs_sql, {SQL.key}) is None
    swap = StepPlan(
        0, new=[new(0, LAW)], scheduled=[(0, 3)], lora_drops=[SQL.key], lora_loads=[LAW]
    )
    assert problem(swap, {SQL.key}) is None


def test_loads_and_drops_that_disagree_are_refused() -> None:
    base = StepPlan(0, new=[new(0, None)], scheduled=[(0, 3)])
    base.lora_drops = [LAW.key]
    assert "drops LoRA adapter 'law'" in str(problem(base, {SQL.key}))
    again = StepPlan(0, lora_loads=[SQL])
    assert "again" in str(problem(again, {SQL.key}, capacity=2))
    full = StepPlan(0, lora_loads=[LAW])
    assert "at most 1" in str(problem(full, {SQL.key}))
    assert "LoRA is off" in str(problem(StepPlan(0, lora_loads=[SQL]), None))
