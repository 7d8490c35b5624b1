"""The order in which the scheduler plans steps, hands them to the workers and takes results.

Synchronously, one plan is in flight: the next is planned once the samples of the last are
in. Planning ahead (async scheduling), the plan of step N+1 goes out while the workers run
step N, its sequences' pending tokens standing in as placeholders, so the workers never wait
for the scheduler's turn. The scheduler process runs this with ZeroMQ around it; the tests
run the same order with a model runner in place of the workers.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from pagedllm.core.request_delta import RequestDelta
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.step_plan import StepPlan, StepResult


def _nothing() -> None:
    pass


class StepPipeline:
    def __init__(
        self, scheduler: Scheduler, send: Callable[[StepPlan], None], plan_ahead: bool
    ) -> None:
        self.scheduler = scheduler
        self._send = send
        self.plan_ahead = plan_ahead
        self.in_flight: deque[StepPlan] = deque()

    @property
    def idle(self) -> bool:
        """No plan is out: the next ``send_next`` plans from scratch."""
        return not self.in_flight

    def _out(self, plan: StepPlan) -> None:
        self._send(plan)
        self.in_flight.append(plan)

    def send_next(self) -> None:
        """Send a plan when none is out and, planning ahead, the one after the plan out."""
        if not self.in_flight:
            self._out(self.scheduler.schedule())
        if self.plan_ahead and len(self.in_flight) == 1:
            ahead = self.scheduler.schedule_ahead(self.in_flight[0])
            if ahead is not None and not ahead.is_empty:
                self._out(ahead)

    def complete(
        self, result: Callable[[StepPlan], StepResult], take_in: Callable[[], None] = _nothing
    ) -> list[RequestDelta]:
        """Apply the oldest plan's ``result``; then ``take_in`` new requests and, when nothing is
        left out, send the next plan before the caller turns to the outputs."""
        plan = self.in_flight.popleft()
        deltas = self.scheduler.update(plan, result(plan))
        take_in()
        if not self.in_flight and self.scheduler.has_work():
            self._out(self.scheduler.schedule())
        return deltas
