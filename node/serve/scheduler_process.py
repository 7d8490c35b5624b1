"""The scheduler process: owns the block manager and the scheduler, drives the workers.

Each step it sends every worker the same plan, waits for rank 0's samples, updates the
requests, and ships the outputs to the API servers (a request answered once gets its first
token, then the rest with its end: see ``output_buffer``). With async scheduling (the default, with
one worker) the plan of the next step is sent before the samples of the current one are back,
its new tokens standing in as placeholders the worker fills in, so the worker never waits for
this process; otherwise the next plan goes out as soon as the samples are in, before the
outputs are encoded. With nothing to do it blocks on its inbox.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass

import zmq

from pagedllm.config import EngineConfig, scheduler_config
from pagedllm.core.output_buffer import OutputBuffer
from pagedllm.core.request_delta import RequestDelta
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.step_pipeline import StepPipeline
from pagedllm.core.step_plan import StepPlan, StepResult
from pagedllm.ipc import messages, sockets
from pagedllm.ipc.messages import (
    AbortRequest,
    AddRequest,
    ProcessReady,
    RequestOutputs,
    RequestRejected,
    StopSequence,
    WorkerReady,
)
from pagedllm.serve.child_process import setup_child
from pagedllm.serve.metrics import SchedulerMetrics

log = logging.getLogger(__name__)
WHERE = "scheduler"


@dataclass
class SchedulerSpec:
    config: EngineConfig
    eos_token_ids: tuple[int, ...]
    ipc_paths: sockets.IpcPaths
    api_server_count: int
    max_waiting: int | None
    model_name: str
    log_level: str
    supervisor_pid: int
    async_scheduling: bool = True


def run_scheduler(spec: SchedulerSpec) -> None:
    setup_child("scheduler", spec.log_level, spec.supervisor_pid)
    try:
        SchedulerLoop(spec).run()
    except Exception:
        log.exception("scheduler failed")
        sys.exit(1)


class SchedulerLoop:
    def __init__(self, spec: SchedulerSpec) -> None:
        self.spec = spec
        paths = spec.ipc_paths
        ctx = zmq.Context()
        self.requests = sockets.pull(ctx, paths.requests)
        self.results = sockets.pull(ctx, paths.results)
        self.workers = [
            sockets.push(ctx, paths.plans(rank)) for rank in range(spec.config.tensor_parallel_size)
        ]
        self.api_servers = [sockets.push(ctx, paths.api(i)) for i in range(spec.api_server_count)]
        self.control = sockets.push(ctx, paths.control)
        self.poller = zmq.Poller()
        self.poller.register(self.requests, zmq.POLLIN)
        self.poller.register(self.results, zmq.POLLIN)
        # request id -> index of the API server that gets its outputs
        self.clients: dict[str, int] = {}
        self.outputs = OutputBuffer()
        self._sent_at: dict[int, float] = {}  # step id -> when its plan was sent
        self._last_result_at = 0.0
        # Async scheduling needs every rank to know the samples; only rank 0 samples.
        self.async_scheduling = spec.async_scheduling and spec.config.tensor_parallel_size == 1
        self.metrics = SchedulerMetrics(spec.model_name)
        ready = self._wait_for_workers()
        self.scheduler = Scheduler(
            scheduler_config(spec.config, ready.num_blocks, ready.max_model_len)
        )
        self.metrics.set_capacity(ready.num_blocks)

    def _wait_for_workers(self) -> WorkerReady:
        while True:
            message = sockets.parse(self.results.recv(), WHERE)
            if isinstance(message, WorkerReady):
                return message

    def run(self) -> None:
        sockets.send(self.control, ProcessReady("scheduler", 0))
        log.info(
            "ready: %d KV blocks%s",
            self.scheduler.config.num_blocks,
            ", async scheduling" if self.async_scheduling else "",
        )
        pipeline = StepPipeline(self.scheduler, self._send, self.async_scheduling)
        while True:
            if pipeline.idle:
                if not self.scheduler.has_work():
                    self.metrics.observe(self.scheduler.stats())
                    self._receive(block=True)
                self._receive(block=False)
            pipeline.send_next()
            deltas = pipeline.complete(
                lambda plan: self._await_result(plan.step_id), lambda: self._receive(block=False)
            )
            self._send_outputs(deltas)
            self.metrics.observe(self.scheduler.stats())

    def _send(self, plan: StepPlan) -> None:
        data = messages.encode(plan)
        for worker in self.workers:
            worker.send(data)
        self._sent_at[plan.step_id] = time.perf_counter()

    def _await_result(self, step_id: int) -> StepResult:
        """Rank 0's result for ``step_id``; requests arriving meanwhile are taken in."""
        while True:
            ready = dict(self.poller.poll())
            if self.requests in ready:
                self._receive(block=False)
            if self.results in ready:
                message = sockets.parse(self.results.recv(), WHERE)
                if isinstance(message, StepResult) and message.step_id == step_id:
                    # The workers' time on this step: from the plan's arrival or the end of
                    # the step before, whichever came last.
                    now = time.perf_counter()
                    started = max(self._sent_at.pop(step_id, now), self._last_result_at)
                    self.metrics.observe_step(now - started)
                    self._last_result_at = now
                    return message
                if message is not None:
                    log.warning("ignored an unexpected %s from the workers", type(message).__name__)

    def _receive(self, block: bool) -> None:
        """Take in what the API servers sent: everything queued, after waiting for the first
        message when ``block``."""
        flags = 0 if block else zmq.NOBLOCK
        while True:
            try:
                data = self.requests.recv(flags)
            except zmq.Again:
                return
            flags = zmq.NOBLOCK
            message = sockets.parse(data, WHERE)
            if isinstance(message, AddRequest):
                self._add(message)
            elif isinstance(message, AbortRequest):
                if self.scheduler.abort(message.request_id):
                    self.clients.pop(message.request_id, None)
                    self.outputs.forget(message.request_id)
            elif isinstance(message, StopSequence):
                final = self.scheduler.stop_sequence(
                    message.request_id, message.index, message.stop
                )
                if final is not None:
                    self._send_outputs([final])
            elif message is not None:
                log.warning("ignored a %s message from an API server", type(message).__name__)

    def _add(self, message: AddRequest) -> None:
        if not 0 <= message.client_index < len(self.api_servers):
            log.warning(
                "dropped request %r from unknown API server %d",
                message.request_id,
                message.client_index,
            )
            return
        client = self.api_servers[message.client_index]
        limit = self.spec.max_waiting
        if limit is not None and len(self.scheduler.waiting) >= limit:
            sockets.send(
                client,
                RequestRejected(
                    message.request_id,
                    503,
                    f"the server is busy: {len(self.scheduler.waiting)} requests are already "
                    f"waiting (--max-waiting {limit}); retry later",
                ),
            )
            return
        try:
            self.scheduler.add_request(
                message.request_id,
                message.prompt_token_ids,
                message.params,
                self.spec.eos_token_ids,
                message.arrival_time,
            )
        except ValueError as error:
            sockets.send(client, RequestRejected(message.request_id, 400, str(error)))
            return
        self.clients[message.request_id] = message.client_index
        if message.final_only:
            self.outputs.hold_after_first(message.request_id)

    def _send_outputs(self, deltas: list[RequestDelta]) -> None:
        by_client: dict[int, list[RequestDelta]] = {}
        for delta in self.outputs.route(deltas, time.monotonic()):
            index = (
                self.clients.pop(delta.request_id, None)
                if delta.finished
                else self.clients.get(delta.request_id)
            )
            if index is not None:
                by_client.setdefault(index, []).append(delta)
        for index, batch in by_client.items():
            sockets.send(self.api_servers[index], RequestOutputs(batch))
