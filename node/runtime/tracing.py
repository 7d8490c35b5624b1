"""Request traces over OTLP (``--otlp-traces-endpoint``, vLLM's flag): one span per engine
request, with its queue, prefill and decode phases as child spans and its token counts as
attributes (vLLM's ``gen_ai.*`` names), sent by the OpenTelemetry SDK's OTLP/HTTP exporter.

Each API server traces the requests it answered, from the timings the scheduler stamps
(``RequestTimings``, ``time.monotonic()``), turned into wall-clock times when the request
ends. Spans go out in batches from the SDK's own thread, so an unreachable collector costs the
event loop nothing; what cannot be sent is dropped with the SDK's log line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, set_span_in_context

from pagedllm.core.request_delta import RequestTimings
from pagedllm.version import __version__

TRACES_PATH = "/v1/traces"
# How long finished spans wait to be sent in one batch.
EXPORT_DELAY_MS = 500
# How long one export may take (also what a shutdown waits at most for an absent collector).
EXPORT_TIMEOUT_S = 5


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL for ``endpoint``: a collector's base URL (``http://host:4318``)
    gets the standard path; a URL with a path is taken as it is. ValueError when it is no
    http(s) URL."""
    parts = urlsplit(endpoint.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"expected an http(s) URL of an OTLP/HTTP collector (e.g. http://collector:4318), "
            f"got {endpoint!r}"
        )
    if parts.path in ("", "/"):
        return endpoint.strip().rstrip("/") + TRACES_PATH
    return endpoint.strip()


@dataclass
class RequestTrace:
    """What one finished engine request's span says."""

    request_id: str
    model: str
    timings: RequestTimings
    prompt_tokens: int
    completion_tokens: int
    n: int
    max_tokens: int | None
    temperature: float
    top_p: float
    finish_reason: str


def _wall_ns(monotonic: float, now_mono: float, now_wall_ns: int) -> int:
    return now_wall_ns - int((now_mono - monotonic) * 1e9)


class RequestTracer:
    def __init__(self, endpoint: str, service_name: str = "pagedllm") -> None:
        resource = Resource.create({"service.name": service_name, "service.version": __version__})
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(endpoint=traces_url(endpoint), timeout=EXPORT_TIMEOUT_S),
                schedule_delay_millis=EXPORT_DELAY_MS,
            )
        )
        self.tracer = self.provider.get_tracer("pagedllm", __version__)

    def record(self, trace: RequestTrace) -> None:
        """The request's span and its phases' (only the phases it reached)."""
        t = trace.timings
        now_mono, now_wall = time.monotonic(), time.time_ns()

        def wall(at: float) -> int:
            return _wall_ns(at, now_mono, now_wall)

        end = t.finished_time if t.finished_time is not None else now_mono
        attributes: dict[str, str | int | float] = {
            "gen_ai.request.id": trace.request_id,
            "gen_ai.response.model": trace.model,
            "gen_ai.request.n": trace.n,
            "gen_ai.request.temperature": trace.temperature,
            "gen_ai.request.top_p": trace.top_p,
            "gen_ai.usage.prompt_tokens": trace.prompt_tokens,
            "gen_ai.usage.completion_tokens": trace.completion_tokens,
            "gen_ai.response.finish_reason": trace.finish_reason,
            "gen_ai.latency.e2e": end - t.arrival_time,
        }
        if trace.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = trace.max_tokens
        # (phase, start, end): queue until first scheduled, prefill until the first token,
        # decode until the end.
        marks = [t.arrival_time, t.first_scheduled_time, t.first_token_time, end]
        phases = []
        for name, start, stop in zip(
            ("queue", "prefill", "decode"), marks[:-1], marks[1:], strict=True
        ):
            if start is None or stop is None:
                break
            phases.append((name, start, stop))
        if t.first_scheduled_time is not None:
            attributes["gen_ai.latency.time_in_queue"] = t.first_scheduled_time - t.arrival_time
        if t.first_token_time is not None:
            attributes["gen_ai.latency.time_to_first_token"] = t.first_token_time - t.arrival_time
        span = self.tracer.start_span(
            "llm_request",
            kind=SpanKind.SERVER,
            start_time=wall(t.arrival_time),
            attributes=attributes,
        )
        context = set_span_in_context(span)
        for name, start, stop in phases:
            child = self.tracer.start_span(name, context=context, start_time=wall(start))
            child.end(end_time=wall(stop))
        span.end(end_time=wall(end))

    def shutdown(self) -> None:
        """Send what is still queued (at most a few seconds)."""
        self.provider.shutdown()
