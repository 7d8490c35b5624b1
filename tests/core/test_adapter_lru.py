"""The scheduler's adapter LRU: what it tells the workers to load and drop, and that a worker
following those plans always holds exactly what the LRU says."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.adapter_lru import AdapterLRU
from pagedllm.lora.request import LoRARequest, adapter_plan_problem


def adapter(i: int, path: str = "/adapters") -> LoRARequest:
    return LoRARequest(f"a{i}", i + 1, f"{path}/{i}")


def test_loads_each_adapter_once_and_drops_the_least_recently_used() -> None:
    lru = AdapterLRU(2)
    assert lru.use([adapter(0)]) == ([adapter(0)], [])
    assert lru.use([adapter(1), adapter(0)]) == ([adapter(1)], [])
    assert lru.use([adapter(0)]) == ([], [])  # held: nothing to do, and now the most recent
    assert lru.use([adapter(2)]) == ([adapter(2)], [adapter(1).key])
    assert lru.loaded() == [adapter(0).key, adapter(2).key]
    assert lru.num_loads == 3


def test_a_name_from_another_directory_is_another_adapter() -> None:
    lru = AdapterLRU(2)
    lru.use([adapter(0)])
    moved = adapter(0, "/elsewhere")
    assert lru.use([moved]) == ([moved], [])
    assert set(lru.loaded()) == {adapter(0).key, moved.key}


def test_a_step_with_more_adapters_than_fit_is_refused() -> None:
    with pytest.raises(ValueError, match="3 adapters"):
        AdapterLRU(2).use([adapter(0), adapter(1), adapter(2)])
    with pytest.raises(ValueError, match="at least one"):
        AdapterLRU(0)


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.integers(1, 4),
    steps=st.lists(st.lists(st.integers(0, 7), max_size=4), max_size=30),
)
def test_a_worker_following_the_plans_holds_what_the_lru_says(
    capacity: int, steps: list[list[int]]
) -> None:
    lru = AdapterLRU(capacity)
    worker: set[tuple[str, str]] = set()
    for step in steps:
        requests = [adapter(i) for i in step[:capacity]]
        loads, drops = lru.use(requests)
        assert adapter_plan_problem(worker, capacity, drops, loads) is None
        worker = (worker - set(drops)) | {r.key for r in loads}
        assert worker == set(lru.loaded())
        assert {r.key for r in requests} <= worker  # the step's adapters are all loaded
        assert len(worker) <= capacity


def test_a_plan_that_disagrees_with_the_worker_is_named() -> None:
    held = {adapter(0).key}
    assert "not loaded" in str(adapter_plan_problem(held, 2, [adapter(1).key], []))
    assert "again" in str(adapter_plan_problem(held, 2, [], [adapter(0)]))
    assert "at most 1" in str(adapter_plan_problem(held, 1, [], [adapter(1)]))
    assert adapter_plan_problem(held, 1, [adapter(0).key], [adapter(1)]) is None
