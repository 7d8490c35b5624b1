"""The router's Prometheus metrics, in a registry of its own (``GET /metrics``)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pagedllm.router.fleet import Fleet
from pagedllm.router.policy import Reason

TOKEN_BUCKETS = (0, 16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, float("inf"))
SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, float("inf"))
# The fixed label values, each series created at zero (per backend when the backend is found), so
# that a reason never seen yet is a 0 rather than a missing series.
UPSTREAM_ERROR_KINDS = ("connect", "unavailable", "broken")
REJECTION_REASONS = ("no_backend", "hold_full", "hold_timeout")


class _FleetCollector(Collector):
    """Per-backend figures read at scrape time, so that a backend that left disappears."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[GaugeMetricFamily]:
        ready = GaugeMetricFamily(
            "pagedllm:router_backend_ready",
            "1 while the backend's feed is live",
            labels=["backend"],
        )
        in_flight = GaugeMetricFamily(
            "pagedllm:router_backend_in_flight",
            "requests this router has sent to the backend and not seen finish",
            labels=["backend"],
        )
        load = GaugeMetricFamily(
            "pagedllm:router_backend_load",
            "requests at the backend: its feed's running and waiting, at least this router's",
            labels=["backend"],
        )
        kv = GaugeMetricFamily(
            "pagedllm:router_backend_kv_usage",
            "the backend's KV-cache usage (0-1)",
            labels=["backend"],
        )
        cached = GaugeMetricFamily(
            "pagedllm:router_backend_cached_blocks",
            "block hashes the backend's prefix cache holds, as its feed says",
            labels=["backend"],
        )
        for b in list(self.fleet.backends.values()):
            ready.add_metric([b.url], float(b.ready))
            in_flight.add_metric([b.url], b.in_flight)
            load.add_metric([b.url], b.load)
            if b.feed_load is not None:
                kv.add_metric([b.url], b.feed_load.kv_usage)
            if b.residency is not None:
                cached.add_metric([b.url], len(b.residency.hashes))
        yield from (ready, in_flight, load, kv, cached)


class RouterMetrics:
    def __init__(self, fleet: Fleet) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.routed = Counter(
            "pagedllm:router_requests_routed",
            "requests sent to a backend, by why that one",
            ["reason"],
            registry=r,
        )
        self.cached_tokens = Histogram(
            "pagedllm:router_predicted_cached_tokens",
            "prompt tokens the chosen backend is predicted to hold",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "pagedllm:router_upstream_errors",
            "backend attempts that failed, by kind (connect, unavailable, broken)",
            ["backend", "kind"],
            registry=r,
        )
        self.rejected = Counter(
            "pagedllm:router_requests_rejected",
            "requests answered 503 by the router itself, by reason",
            ["reason"],
            registry=r,
        )
        self.routing_seconds = Histogram(
            "pagedllm:router_added_latency_seconds",
            "time from a request's arrival to its forwarding (parsing, tokenizing, choosing)",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.held = Gauge(
            "pagedllm:router_held_requests", "requests waiting for a ready backend", registry=r
        )
        r.register(_FleetCollector(fleet))
        for reason in Reason:
            self.routed.labels(reason.value)
        for reason in REJECTION_REASONS:
            self.rejected.labels(reason)
        for url in fleet.backends:
            self.backend_changed(url, True)
        fleet.membership_listeners.append(self.backend_changed)

    def backend_changed(self, url: str, joined: bool) -> None:
        """A backend's error series exist, at zero, exactly while it is in the fleet."""
        for kind in UPSTREAM_ERROR_KINDS:
            if joined:
                self.upstream_errors.labels(url, kind)
            else:
                self.upstream_errors.remove(url, kind)

    def render(self) -> bytes:
        return generate_latest(self.registry)
