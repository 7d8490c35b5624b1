"""The scheduler's step deadline: never under its floor, and as long as the measured speed
says a step of that size may take, with room to spare."""

from __future__ import annotations

import pytest

from pagedllm.core.step_deadline import SLACK, StepDeadline


def test_an_unmeasured_node_waits_the_floor():
    deadline = StepDeadline(floor_s=60.0)
    assert deadline.seconds_for(1) == deadline.seconds_for(100_000) == 60.0


def test_a_long_step_on_a_slow_node_gets_what_its_size_needs():
    deadline = StepDeadline(floor_s=60.0)
    deadline.observe(num_tokens=100, seconds=1.0)  # 10 ms a token
    assert deadline.seconds_for(1) == 60.0
    assert deadline.seconds_for(2048) == pytest.approx(SLACK * 0.01 * 2048)
    assert deadline.seconds_for(4096) == pytest.approx(2 * deadline.seconds_for(2048))


def test_one_odd_step_moves_the_rate_a_little_and_empty_steps_not_at_all():
    deadline = StepDeadline(floor_s=1.0)
    for _ in range(20):
        deadline.observe(10, 0.1)
    steady = deadline.seconds_per_token
    deadline.observe(0, 5.0)
    assert deadline.seconds_per_token == steady
    deadline.observe(10, 10.0)  # a hundred times slower, once
    assert steady < deadline.seconds_per_token < 20 * steady
