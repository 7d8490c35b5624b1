"""Prometheus metrics with vLLM's names, so existing dashboards and autoscalers work.

The node's processes share one prometheus multiprocess directory (``PROMETHEUS_MULTIPROC_DIR``,
set by the supervisor before it starts them): the scheduler writes the queue, cache and token
figures, each API server the per-request latencies and outcomes, and whichever API server
answers ``/metrics`` reads them all, so the figures are right however many API servers run.
Figures of our own are named ``pagedllm:*``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY as DEFAULT_REGISTRY
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
    values,
)

from pagedllm.core.sequence import FinishReason

if TYPE_CHECKING:
    # Type-only: the API servers import this module and need no part of the scheduler.
    from pagedllm.core.reporting import SchedulerStats
    from pagedllm.runtime.tracing import RequestTrace, RequestTracer

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
LABEL = "model_name"

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
STEP_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)


# The fixed values of the labelled counters, each series created at zero when its process starts:
# a reason never seen yet is a 0, not a missing series (Prometheus' guidance for known labels).
# A request's finish as the engine reports it.
FINISH_REASONS = tuple(reason.value for reason in FinishReason)
# Why the API server refused a request before generation.
REJECTION_REASONS = ("queue_full", "invalid")


def use_multiprocess_dir(directory: str) -> None:
    """Make this process and the children it starts from now on share ``directory``."""
    os.makedirs(directory, exist_ok=True)
    os.environ[MULTIPROC_ENV] = directory
    # prometheus_client chose its value storage when it was imported; choose again.
    values.ValueClass = values.get_value_class()


def render() -> bytes:
    """The exposition text of every process's metrics."""
    if os.environ.get(MULTIPROC_ENV):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)
    return generate_latest(DEFAULT_REGISTRY)


# Metrics are not registered anywhere: in multiprocess mode the files are what is collected.
def _gauge(name: str, doc: str, model: str) -> Gauge:
    return Gauge(name, doc, [LABEL], registry=None, multiprocess_mode="mostrecent").labels(model)


def _counter(name: str, doc: str, model: str) -> Counter:
    return Counter(name, doc, [LABEL], registry=None).labels(model)


def _histogram(name: str, doc: str, model: str, buckets: tuple[float, ...]) -> Histogram:
    return Histogram(name, doc, [LABEL], registry=None, buckets=buckets).labels(model)


class SchedulerMetrics:
    """The scheduler's view: queue depth, KV-cache use, prefix cache, token totals."""

    def __init__(self, model: str, num_speculative_tokens: int = 0) -> None:
        self.running = _gauge(
            "vllm:num_requests_running", "Requests being generated (in the running batch).", model
        )
        self.waiting = _gauge("vllm:num_requests_waiting", "Requests waiting to run.", model)
        self.kv_usage = _gauge(
            "vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", model
        )
        self.prefix_queries = _counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", model
        )
        self.prefix_hits = _counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", model
        )
        self.preemptions = _counter(
            "vllm:num_preemptions", "Sequences preempted for lack of KV-cache blocks.", model
        )
        self.prompt_tokens = _counter("vllm:prompt_tokens", "Prompt tokens processed.", model)
        self.generation_tokens = _counter("vllm:generation_tokens", "Tokens generated.", model)
        self.num_blocks = _gauge(
            "pagedllm:kv_cache_blocks", "KV-cache blocks the node holds.", model
        )
        self.kv_waste = _gauge(
            "pagedllm:kv_cache_waste_perc",
            "Allocated KV slots holding no token, over allocated slots (0-1).",
            model,
        )
        self.kv_shared = _gauge(
            "pagedllm:kv_cache_shared_blocks",
            "KV-cache blocks referenced by more than one sequence.",
            model,
        )
        self.step_duration = _histogram(
            "pagedllm:step_duration_seconds",
            "Model step as the scheduler sees it: plan sent to samples back.",
            model,
            STEP_BUCKETS,
        )
        self.spec_drafts = _counter(
            "vllm:spec_decode_num_drafts", "Drafts verified by speculative decoding.", model
        )
        self.spec_draft_tokens = _counter(
            "vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", model
        )
        self.spec_accepted_tokens = _counter(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", model
        )
        self._spec_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft.",
            [LABEL, "position"],
            registry=None,
        )
        for position in range(num_speculative_tokens):
            self._spec_per_pos.labels(model, str(position))
        # vLLM's shape: the labels list the adapters of running and waiting requests; the
        # value is when they were seen (a reader takes the newest series).
        self.lora_info = Gauge(
            "vllm:lora_requests_info",
            "LoRA adapters of running and waiting requests (value: when seen, Unix seconds).",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=None,
            multiprocess_mode="mostrecent",
        )
        # 1 for each adapter requests may name now, 0 for one dropped since (a series, once
        # written, stays in the multiprocess files): what the operator's status counts.
        self._adapter_served = Gauge(
            "pagedllm:lora_adapter_served",
            "1 while the LoRA adapter is served, 0 once it was unloaded.",
            [LABEL, "adapter"],
            registry=None,
            multiprocess_mode="mostrecent",
        )
        self._adapters: set[str] = set()
        self.lora_loads = _counter(
            "pagedllm:lora_adapter_loads",
            "LoRA adapters loaded into the workers (each load reads the adapter's files).",
            model,
        )
        self._model = model
        # The totals last reported, so that the counters grow by the difference.
        self._totals: dict[Counter, int] = {}

    def served_adapters(self, adapters: Iterable[str]) -> None:
        """The adapters served from now on (all of them, each time the list changes)."""
        current = set(adapters)
        for adapter in current | self._adapters:
            self._adapter_served.labels(self._model, adapter).set(int(adapter in current))
        self._adapters = current

    def set_capacity(self, num_blocks: int) -> None:
        self.num_blocks.set(num_blocks)

    def observe_step(self, seconds: float) -> None:
        self.step_duration.observe(seconds)

    def observe(self, stats: SchedulerStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        self.kv_waste.set(stats.kv_waste)
        self.kv_shared.set(stats.kv_shared_blocks)
        if stats.max_loras:
            self.lora_info.labels(
                str(stats.max_loras),
                ",".join(stats.running_adapters),
                ",".join(stats.waiting_adapters),
            ).set(time.time())
        for counter, total in (
            (self.prefix_queries, stats.prefix_queries),
            (self.prefix_hits, stats.prefix_hits),
            (self.preemptions, stats.num_preemptions),
            (self.prompt_tokens, stats.prompt_tokens),
            (self.generation_tokens, stats.generation_tokens),
            (self.lora_loads, stats.lora_loads),
            *self._spec_totals(stats),
        ):
            before = self._totals.get(counter, 0)
            if total > before:
                counter.inc(total - before)
            self._totals[counter] = total

    def _spec_totals(self, stats: SchedulerStats) -> list[tuple[Counter, int]]:
        spec = stats.spec_decode
        if spec is None:
            return []
        return [
            (self.spec_drafts, spec.num_drafts),
            (self.spec_draft_tokens, spec.num_draft_tokens),
            (self.spec_accepted_tokens, spec.num_accepted_tokens),
            *(
                (self._spec_per_pos.labels(self._model, str(pos)), count)
                for pos, count in enumerate(spec.accepted_per_pos)
            ),
        ]


class RequestRecorder:
    """An API server's view: what each request it answered experienced (and, with
    ``--otlp-traces-endpoint``, each request's trace)."""

    def __init__(
        self, model: str, tracer: RequestTracer | None = None, adapters: Iterable[str] = ()
    ) -> None:
        self.model = model
        self.tracer = tracer
        self.lora_requests = Counter(
            "pagedllm:lora_requests",
            "Requests for each LoRA adapter.",
            [LABEL, "adapter"],
            registry=None,
        )
        for adapter in adapters:
            self.lora_requests.labels(model, adapter)
        self.success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            [LABEL, "finished_reason"],
            registry=None,
        )
        self.rejected = Counter(
            "pagedllm:requests_rejected",
            "Requests refused before generation, by reason.",
            [LABEL, "reason"],
            registry=None,
        )
        for reason in FINISH_REASONS:
            self.success.labels(model, reason)
        for reason in REJECTION_REASONS:
            self.rejected.labels(model, reason)
        self.ttft = _histogram(
            "vllm:time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            model,
            TTFT_BUCKETS,
        )
        self.itl = _histogram(
            "vllm:inter_token_latency_seconds",
            "Time between successive output steps of a request.",
            model,
            ITL_BUCKETS,
        )
        self.e2e = _histogram(
            "vllm:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            model,
            REQUEST_BUCKETS,
        )
        self.queue = _histogram(
            "vllm:request_queue_time_seconds",
            "Time a request waited before it was first scheduled.",
            model,
            REQUEST_BUCKETS,
        )

    def lora_request(self, adapter: str) -> None:
        self.lora_requests.labels(self.model, adapter).inc()

    def finished(self, reason: str) -> None:
        self.success.labels(self.model, reason).inc()

    def trace(self, trace: RequestTrace) -> None:
        if self.tracer is not None:
            self.tracer.record(trace)

    def rejected_for(self, reason: str) -> None:
        self.rejected.labels(self.model, reason).inc()
