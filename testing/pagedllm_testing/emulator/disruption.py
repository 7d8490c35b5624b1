"""PodDisruptionBudget arithmetic, as the API server's eviction handler and the disruption
controller do it (pure): how many pods a budget expects, how many are healthy, and whether
evicting one more pod is allowed.

- expected pods: the replicas of the controllers of the pods the budget selects (a
  ReplicaSet owned by a Deployment counts as the Deployment, a rollout's ReplicaSets as one);
  with an integer minAvailable, or for pods without a controller, the pods selected.
- desired healthy: minAvailable (a percentage of expected, rounded up), or expected minus
  maxUnavailable (a percentage of expected, rounded up).
- healthy: selected pods, not being deleted, whose Ready condition is True.
- a healthy pod may be evicted while healthy - desired healthy > 0 (disruptionsAllowed); an
  unhealthy one always under unhealthyPodEvictionPolicy AlwaysAllow, and under the default
  IfHealthyBudget while healthy >= desired healthy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagedllm_testing.emulator.selectors import parse_label_selector, selector_string

ALWAYS_ALLOW = "AlwaysAllow"


@dataclass(frozen=True)
class Budget:
    """A budget's numbers at one moment (what the disruption controller puts in its status)."""

    expected: int
    desired_healthy: int
    healthy: int

    @property
    def disruptions_allowed(self) -> int:
        return max(self.healthy - self.desired_healthy, 0)


def selects(pdb: Mapping[str, Any], pod: Mapping[str, Any]) -> bool:
    """Whether the budget's selector matches the pod (same namespace; policy/v1: an empty
    selector matches every pod)."""
    if pdb["metadata"].get("namespace") != pod["metadata"].get("namespace"):
        return False
    requirements = parse_label_selector(selector_string(pdb["spec"].get("selector")))
    labels = pod["metadata"].get("labels") or {}
    return all(requirement.matches(labels) for requirement in requirements)


def is_healthy(pod: Mapping[str, Any]) -> bool:
    if pod["metadata"].get("deletionTimestamp"):
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def _controller(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return next(
        (ref for ref in obj["metadata"].get("ownerReferences") or [] if ref.get("controller")),
        None,
    )


def scaled_by_percent(value: int | str, total: int) -> int:
    """An int-or-percent of `total`, percentages rounded up (as budgets resolve both fields)."""
    if isinstance(value, int):
        return value
    if value.endswith("%"):
        return math.ceil(total * int(value[:-1]) / 100)
    return int(value)


def expected_pods(
    pdb: Mapping[str, Any],
    pods: Sequence[Mapping[str, Any]],
    owners: Mapping[str, Mapping[str, Any]],
) -> int:
    """`pods`: those the budget selects; `owners`: workload objects by uid (ReplicaSets,
    Deployments, StatefulSets) to read their replicas from."""
    min_available = pdb["spec"].get("minAvailable")
    if isinstance(min_available, int) and "maxUnavailable" not in pdb["spec"]:
        return len(pods)
    scales: dict[str, int] = {}
    for pod in pods:
        ref = _controller(pod)
        owner = owners.get(ref["uid"]) if ref else None
        if owner is None:
            return len(pods)  # a pod without a (known) controller: count what is there
        parent_ref = _controller(owner) if owner["kind"] == "ReplicaSet" else None
        parent = owners.get(parent_ref["uid"]) if parent_ref else None
        scaled = parent or owner
        scales[scaled["metadata"]["uid"]] = (scaled.get("spec") or {}).get("replicas", 1)
    return sum(scales.values())


def budget(
    pdb: Mapping[str, Any],
    pods: Sequence[Mapping[str, Any]],
    owners: Mapping[str, Mapping[str, Any]],
) -> Budget:
    """The budget over the namespace's `pods` (it picks the ones it selects)."""
    selected = [p for p in pods if selects(pdb, p)]
    expected = expected_pods(pdb, selected, owners)
    spec = pdb["spec"]
    if "maxUnavailable" in spec:
        desired = max(expected - scaled_by_percent(spec["maxUnavailable"], expected), 0)
    else:
        desired = scaled_by_percent(spec.get("minAvailable", 1), expected)
    return Budget(expected, desired, sum(1 for p in selected if is_healthy(p)))


def eviction_allowed(pdb: Mapping[str, Any], current: Budget, pod: Mapping[str, Any]) -> bool:
    if is_healthy(pod):
        return current.disruptions_allowed > 0
    if pdb["spec"].get("unhealthyPodEvictionPolicy") == ALWAYS_ALLOW:
        return True
    return current.healthy >= current.desired_healthy
