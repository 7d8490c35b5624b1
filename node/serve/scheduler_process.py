"""The scheduler process: owns the block manager and the scheduler, drives the workers.

Each step it sends every worker the same plan, waits for rank 0's samples, updates the
requests, and ships the outputs to the API servers (a request answered once gets its first
token, then the rest with its end: see ``output_buffer``). With async scheduling (the default, with
one worker) the plan of the next step is sent before the samples of the current one are back,
its new tokens standing in as placeholders the worker fills in, so the worker never waits for
this process; otherwise the next plan goes out as soon as the samples are in, before the
outputs are encoded. With nothing to do it waits on its inbox. After each step, and while it
waits, it sends the API servers the prefix cache's changes and the load (``kv_event_sender``),
and the block map to those that show it (``kv_map_sender``).

A node that cannot make progress fails loudly: a step the workers refuse, a step whose results
are overdue (``StepDeadline``) or results that cannot belong to the step end this process after
it has told the supervisor why (``NodeFailed``), which fails every request in flight with that
reason and exits non-zero, for Kubernetes to restart the pod.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field

import zmq

from pagedllm.config import EngineConfig, scheduler_config
from pagedllm.core.output_buffer import OutputBuffer
from pagedllm.core.request_delta import RequestDelta
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import GrammarRef
from pagedllm.core.speculative import parse_speculative_config
from pagedllm.core.step_deadline import StepDeadline
from pagedllm.core.step_pipeline import StepPipeline
from pagedllm.core.step_plan import StepPlan, StepResult
from pagedllm.ipc import messages, sockets
from pagedllm.ipc.messages import (
    AbortRequest,
    AddRequest,
    CacheLayout,
    LoadLoRAAdapter,
    LoRAAdapters,
    LoRAAdapterUpdated,
    NodeFailed,
    ProcessReady,
    RequestOutputs,
    RequestRejected,
    StepRefused,
    StopSequence,
    UnloadLoRAAdapter,
    WatchKVMap,
    WorkerReady,
)
from pagedllm.lora.peft_files import Shapes
from pagedllm.models.tokenizer import load_tokenizer
from pagedllm.runtime.child_process import setup_child
from pagedllm.runtime.metrics import SchedulerMetrics
from pagedllm.serve.grammar_intake import Compiled, GrammarIntake
from pagedllm.serve.kv_event_sender import HEARTBEAT_S, KVEventSender
from pagedllm.serve.kv_map_sender import KVMapSender
from pagedllm.serve.lora_registry import LoRARegistry
from pagedllm.structured.compiler import GrammarCompiler, tokenizer_info

log = logging.getLogger(__name__)
WHERE = "scheduler"
# After telling the supervisor the node is stuck: how long to wait to be stopped by it.
STOPPED_BY_SUPERVISOR_S = 10.0
# With nothing else to do but grammars compiling: how often to look whether they are done.
COMPILE_POLL_MS = 2


class NodeStuck(Exception):
    """The workers will not or cannot finish the step the scheduler waits for."""


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
    step_timeout: float = 60.0
    # Where the tokenizer is (--tokenizer, or the model's own: a GGUF file holds its own), for
    # compiling grammars (None: no structured outputs).
    tokenizer_dir: str | None = None
    # LoRA (--enable-lora): the adapters of --lora-modules, the model's projections, and the
    # base model's names (not an adapter's).
    lora_modules: dict[str, str] = field(default_factory=dict)
    lora_shapes: Shapes = field(default_factory=dict)
    model_names: tuple[str, ...] = ()


def run_scheduler(spec: SchedulerSpec) -> None:
    setup_child("scheduler", spec.log_level, spec.supervisor_pid, spec.ipc_paths.directory)
    try:
        loop = SchedulerLoop(spec)
        loop.run()
    except NodeStuck as stuck:
        log.error("%s", stuck)
        sockets.send(loop.control, NodeFailed(str(stuck)))
        time.sleep(STOPPED_BY_SUPERVISOR_S)
        sys.exit(1)
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
        speculative = parse_speculative_config(spec.config.speculative_config)
        self.metrics = SchedulerMetrics(
            spec.model_name, speculative.num_speculative_tokens if speculative else 0
        )
        ready = self._wait_for_workers()
        self.scheduler = Scheduler(
            scheduler_config(spec.config, ready.num_blocks, ready.max_model_len)
        )
        self.vocab_size = ready.vocab_size
        self.grammars = GrammarIntake(self._grammar_compiler())
        self.deadline = StepDeadline(spec.step_timeout)
        self.metrics.set_capacity(ready.num_blocks)
        config = self.scheduler.config
        self.kv_events = KVEventSender(
            self.scheduler.block_manager.pool,
            self.api_servers,
            CacheLayout(config.block_size, config.seed, config.num_blocks),
        )
        self.kv_map = KVMapSender(self.scheduler, self.api_servers)
        self.loras = (
            LoRARegistry(
                spec.config.max_lora_rank,
                spec.lora_shapes,
                spec.model_names,
                dict(spec.lora_modules),
            )
            if spec.config.enable_lora
            else None
        )
        if self.loras is not None:
            self.metrics.served_adapters(self.loras.adapters)

    def _grammar_compiler(self) -> GrammarCompiler | None:
        if self.spec.tokenizer_dir is None:
            return None
        tokenizer = load_tokenizer(self.spec.tokenizer_dir)
        return GrammarCompiler(
            tokenizer_info(tokenizer, self.vocab_size, list(self.spec.eos_token_ids))
        )

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
                    self._wait_for_requests()
                self._receive()
            self._admit_compiled()
            pipeline.send_next()
            deltas = pipeline.complete(self._await_result, self._receive)
            self._send_outputs(deltas)
            self._report()

    def _report(self) -> None:
        stats = self.scheduler.stats()
        self.metrics.observe(stats)
        self.kv_events.publish(stats, {} if self.loras is None else self.loras.adapters)
        self.kv_map.publish(stats)

    def _wait_for_requests(self) -> None:
        """Wait until an API server sends something, reporting the idle node meanwhile; with
        grammars compiling, only briefly, so that a compiled request starts at once."""
        self._report()
        if self.grammars.pending:
            self.requests.poll(COMPILE_POLL_MS)
            return
        while not self.requests.poll(int(HEARTBEAT_S * 1000)):
            self._report()

    def _send(self, plan: StepPlan) -> None:
        data = messages.encode(plan)
        for worker in self.workers:
            worker.send(data)
        self._sent_at[plan.step_id] = time.perf_counter()

    def _await_result(self, plan: StepPlan) -> StepResult:
        """Rank 0's result for ``plan``; requests arriving meanwhile are taken in. Raises
        NodeStuck when the workers refuse the plan, answer it with results that cannot be
        its own, or let its deadline pass."""
        step_id = plan.step_id
        waited_from = time.perf_counter()
        allowed = self.deadline.seconds_for(plan.num_tokens)
        while True:
            left = waited_from + allowed - time.perf_counter()
            if left <= 0:
                raise NodeStuck(
                    f"step {step_id} ({plan.num_tokens} tokens, {len(plan.scheduled)} "
                    f"sequences) is overdue: no result from the workers after {allowed:.0f} s "
                    "(--step-timeout)"
                )
            ready = dict(self.poller.poll(max(1, int(left * 1000))))
            if self.requests in ready:
                self._receive()
            if self.results not in ready:
                continue
            message = sockets.parse(self.results.recv(), WHERE)
            if isinstance(message, StepRefused):
                if message.step_id in self._sent_at:
                    raise NodeStuck(
                        f"the workers refused step plan {message.step_id}: {message.reason}"
                    )
                log.warning(
                    "ignored the workers' refusal of step plan %d, which this scheduler did "
                    "not send: %s",
                    message.step_id,
                    message.reason,
                )
                continue
            if isinstance(message, StepResult) and message.step_id == step_id:
                problem = self._result_problem(plan, message)
                if problem is not None:
                    raise NodeStuck(f"the workers' result of step {step_id} {problem}")
                # The workers' time on this step: from the plan's arrival or the end of
                # the step before, whichever came last.
                now = time.perf_counter()
                started = max(self._sent_at.pop(step_id, now), self._last_result_at)
                self.metrics.observe_step(now - started)
                self.deadline.observe(plan.num_tokens, now - started)
                self._last_result_at = now
                return message
            if message is not None:
                log.warning("ignored an unexpected %s from the workers", type(message).__name__)

    def _result_problem(self, plan: StepPlan, result: StepResult) -> str | None:
        """What makes ``result`` impossible as the answer to ``plan``, or None."""
        scheduled = {seq_id for seq_id, _ in plan.scheduled}
        for part in (*result.samples, *result.prompt_logprobs):
            if part.seq_id not in scheduled:
                return f"has an entry for sequence {part.seq_id}, which the step did not run"
        tokens = [t for s in result.samples for t in s.token_ids]
        if tokens and not 0 <= min(tokens) <= max(tokens) < self.vocab_size:
            return f"samples token ids outside [0, {self.vocab_size})"
        return None

    def _receive(self) -> None:
        """Take in everything the API servers sent that is queued."""
        while True:
            try:
                data = self.requests.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            message = sockets.parse(data, WHERE)
            if isinstance(message, AddRequest):
                self._add(message)
            elif isinstance(message, AbortRequest):
                self._abort(message.request_id)
            elif isinstance(message, WatchKVMap):
                if not self.kv_map.watch(message.client_index):
                    log.warning(
                        "ignored a block-map watch from unknown API server %d", message.client_index
                    )
            elif isinstance(message, StopSequence):
                final = self.scheduler.stop_sequence(
                    message.request_id, message.index, message.stop
                )
                if final is not None:
                    self._send_outputs([final])
            elif isinstance(message, LoadLoRAAdapter | UnloadLoRAAdapter):
                self._update_adapters(message)
            elif message is not None:
                log.warning("ignored a %s message from an API server", type(message).__name__)

    def _abort(self, request_id: str) -> None:
        if self.grammars.abort(request_id):
            self.clients.pop(request_id, None)
        elif self.scheduler.abort(request_id):
            self.clients.pop(request_id, None)
            self.outputs.forget(request_id)

    def _update_adapters(self, message: LoadLoRAAdapter | UnloadLoRAAdapter) -> None:
        """Load or unload an adapter; every API server learns the new list before the one that
        asked has its answer."""
        if not 0 <= message.client_index < len(self.api_servers):
            log.warning(
                "ignored an adapter update from unknown API server %d", message.client_index
            )
            return
        if self.loras is None:
            status, text = 400, "LoRA is not enabled on this server (--enable-lora)"
        elif isinstance(message, LoadLoRAAdapter):
            status, text = self.loras.load(message.lora_name, message.lora_path)
        else:
            status, text = self.loras.unload(message.lora_name)
        if status == 200 and self.loras is not None:
            self.metrics.served_adapters(self.loras.adapters)
            for server in self.api_servers:
                sockets.send(server, LoRAAdapters(dict(self.loras.adapters)))
            log.info("%s", text)
        client = self.api_servers[message.client_index]
        sockets.send(client, LoRAAdapterUpdated(message.request_id, status, text))

    def _add(self, message: AddRequest) -> None:
        if not 0 <= message.client_index < len(self.api_servers):
            log.warning(
                "dropped request %r from unknown API server %d",
                message.request_id,
                message.client_index,
            )
            return
        ids = message.prompt_token_ids
        if ids and not 0 <= min(ids) <= max(ids) < self.vocab_size:
            self._reject(
                message,
                400,
                f"prompt token ids must be in [0, {self.vocab_size}) for this model",
            )
            return
        limit = self.spec.max_waiting
        if limit is not None and message.first_of_request and len(self.scheduler.waiting) >= limit:
            self._reject(
                message,
                503,
                f"the server is busy: {len(self.scheduler.waiting)} requests are already "
                f"waiting (--max-waiting {limit}); retry later",
            )
            return
        if message.params.structured_outputs is None:
            self._queue(message, None)
            return
        compiled = self.grammars.submit(message)
        if compiled is None:  # compiling: an abort meanwhile finds its client here
            self.clients[message.request_id] = message.client_index
        else:
            self._queue_compiled(compiled)

    def _admit_compiled(self) -> None:
        for compiled in self.grammars.ready():
            self._queue_compiled(compiled)

    def _queue_compiled(self, compiled: Compiled) -> None:
        message = compiled.message
        self.clients.pop(message.request_id, None)
        if compiled.grammar is None:
            self._reject(message, 400, compiled.error or "cannot compile")
        else:
            self._queue(message, compiled.grammar)

    def _queue(self, message: AddRequest, grammar: GrammarRef | None) -> None:
        """Hand the request to the scheduler (its grammar compiled, if it has one)."""
        try:
            self.scheduler.add_request(
                message.request_id,
                message.prompt_token_ids,
                message.params,
                self.spec.eos_token_ids,
                message.arrival_time,
                grammar,
                message.lora,
            )
        except ValueError as error:
            self._reject(message, 400, str(error))
            return
        self.clients[message.request_id] = message.client_index
        if message.final_only:
            self.outputs.hold_after_first(message.request_id)

    def _reject(self, message: AddRequest, status: int, reason: str) -> None:
        client = self.api_servers[message.client_index]
        sockets.send(client, RequestRejected(message.request_id, status, reason))

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
