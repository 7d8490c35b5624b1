"""The built-in autoscaler's decision (pure): per-pod LLM load in, replicas out.

Like a HorizontalPodAutoscaler on a pods metric: desired = ceil(total load / target), within
[minReplicas, maxReplicas], ignoring changes within a 10 % tolerance. Up at once; down only to
the highest recommendation of the last scaleDownDelaySeconds, and only once that much load
history has been seen (so a restarted operator does not scale down on its first look).

Requests the routers hold while no pod is ready are load too: they add to the request-count
metrics (they are queued work the pods have not seen yet) and, whatever the metric, keep at
least one replica, so a PagedLLM is never scaled to zero while anything waits for it and is
scaled up from zero as soon as anything does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from pagedllm.operator.spec import AutoscalingSpec, Metric

TOLERANCE = 0.1


@dataclass(frozen=True)
class Recommendation:
    at: float
    replicas: int


@dataclass(frozen=True)
class AutoscalerState:
    observing_since: float | None = None
    recommendations: tuple[Recommendation, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class Decision:
    replicas: int
    # Average of the metric over the ready pods that answered; None without any.
    average: float | None
    explanation: str

    def changes(self, current: int) -> bool:
        return self.replicas != current


def held_load(held: float, scaling: AutoscalingSpec) -> float:
    """What held requests add to the metric's total: requests for the request-count metrics,
    nothing to a usage fraction (they still keep one replica, see ``recommend``)."""
    return 0.0 if scaling.metric is Metric.KV_CACHE_USAGE else held


def recommend(
    current: int, per_pod: Sequence[float], scaling: AutoscalingSpec, held: float = 0.0
) -> int:
    """``per_pod`` may be empty only with requests ``held``."""
    total = sum(per_pod) + held_load(held, scaling)
    average = total / max(len(per_pod), 1)
    if per_pod and current > 0 and abs(average / scaling.target - 1) <= TOLERANCE:
        wanted = current
    else:
        wanted = math.ceil(total / scaling.target - 1e-9)
    if held > 0:
        wanted = max(wanted, 1)
    return min(max(wanted, scaling.min_replicas), scaling.max_replicas)


def decide(
    state: AutoscalerState,
    *,
    current: int,
    ready: int,
    per_pod: Sequence[float],
    scaling: AutoscalingSpec,
    now: float,
    held: float = 0.0,
) -> tuple[Decision, AutoscalerState]:
    """`per_pod`: the metric of each ready pod that answered; `ready`: how many pods are
    ready (some may not have answered); `held`: requests the routers hold for a ready pod."""
    bounded = min(max(current, scaling.min_replicas), scaling.max_replicas)
    if not per_pod and held > 0:
        # Waiting for capacity: at zero (the routers also write /scale), or pods starting.
        wanted = max(bounded, recommend(current, per_pod, scaling, held))
        explanation = f"{held:g} requests held by the routers, no pod ready"
        if wanted > current:
            explanation += ": scaling up"
        return Decision(wanted, None, explanation), AutoscalerState()
    if not per_pod:
        # Nothing to measure: either scaled to zero (only /scale brings it back) or all pods
        # are still starting. Hold, except to bring replicas back within bounds.
        explanation = "no ready pod reported metrics"
        return Decision(bounded, None, explanation), AutoscalerState()

    average = sum(per_pod) / len(per_pod)
    recommended = recommend(current, per_pod, scaling, held)
    window = scaling.scale_down_delay_seconds
    observing_since = state.observing_since if state.observing_since is not None else now
    history = tuple(r for r in state.recommendations if r.at > now - window)
    history += (Recommendation(now, recommended),)
    new_state = AutoscalerState(observing_since, history)

    load = (
        f"average {scaling.metric.value} {average:.2f} per ready pod over {len(per_pod)} "
        f"pod(s), target {scaling.target:g}"
    )
    if held > 0:
        load += f", {held:g} requests held by the routers"
    if recommended > bounded:
        return Decision(recommended, average, f"{load}: scaling up"), new_state
    seen_full_window = now - observing_since >= window
    # Pods still starting would read as idle; only a settled deployment may shrink.
    settled = ready >= current
    highest = max(r.replicas for r in history)
    if highest < bounded and seen_full_window and settled:
        return Decision(highest, average, f"{load}: lower for {window}s, scaling down"), new_state
    return Decision(bounded, average, load), new_state


def parse_prometheus_value(text: str, metric_name: str) -> float | None:
    """Sum of the samples of one metric in Prometheus text exposition (None if absent).
    Raises ValueError for text that is not in the exposition format."""
    values = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == metric_name and not math.isnan(sample.value)
    ]
    return sum(values) if values else None
