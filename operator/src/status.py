"""The PagedLLM's status, computed from what its Deployment and pods report (pure)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
ROUTER = "Router"

# Container waiting reasons that will not fix themselves.
FAILING_WAIT_REASONS = (
    "CrashLoopBackOff",
    "ImagePullBackOff",
    "ErrImagePull",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
)
UNSCHEDULABLE = "Unschedulable"


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str


@dataclass(frozen=True)
class PodProblem:
    pod: str
    reason: str
    message: str


def pod_problems(pods: Sequence[Mapping[str, Any]]) -> list[PodProblem]:
    """Pods that cannot run: unschedulable (no capacity yet) or failing containers."""
    problems = []
    for pod in pods:
        if pod.get("metadata", {}).get("deletionTimestamp"):
            continue
        name = pod["metadata"]["name"]
        status = pod.get("status") or {}
        for condition in status.get("conditions") or []:
            if (
                condition.get("type") == "PodScheduled"
                and condition.get("status") == "False"
                and condition.get("reason") == UNSCHEDULABLE
            ):
                problems.append(PodProblem(name, UNSCHEDULABLE, condition.get("message", "")))
        for container in [
            *(status.get("initContainerStatuses") or []),
            *(status.get("containerStatuses") or []),
        ]:
            waiting = (container.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in FAILING_WAIT_REASONS:
                message = waiting.get("message") or ""
                terminated = (container.get("lastState") or {}).get("terminated") or {}
                if terminated:
                    message = (
                        f"{message}; last exit code {terminated.get('exitCode')}"
                        f" ({terminated.get('reason', 'Error')})"
                    ).lstrip("; ")
                problems.append(
                    PodProblem(
                        name, waiting["reason"], f"container {container.get('name')}: {message}"
                    )
                )
    return problems


@dataclass(frozen=True)
class RouterObserved:
    """What the cluster says about the router pods, and how many are wanted."""

    wanted: int
    deployment: Mapping[str, Any] | None
    pods: Sequence[Mapping[str, Any]]

    @property
    def ready(self) -> int:
        return ((self.deployment or {}).get("status") or {}).get("readyReplicas", 0)


@dataclass(frozen=True)
class Observed:
    """What the cluster says about the serving pods (and the routers, when enabled)."""

    deployment: Mapping[str, Any] | None
    pods: Sequence[Mapping[str, Any]]
    router: RouterObserved | None = None
    # The adapters each ready serving pod that answered reports served (its /metrics).
    served_adapters: Sequence[frozenset[str]] = ()


def adapters_status(
    names: Sequence[str], served: Sequence[frozenset[str]]
) -> list[dict[str, Any]] | None:
    """status.adapters: each adapter of the spec and how many pods serve it; None (the field
    removed by the merge patch) when the spec lists none."""
    if not names:
        return None
    return [{"name": name, "loadedPods": sum(name in pod for pod in served)} for name in names]


def router_condition(router: RouterObserved | None) -> Condition:
    if router is None:
        return Condition(
            ROUTER,
            False,
            "Disabled",
            "spec.router.enabled is false: the Service spreads requests over the serving pods",
        )
    message = f"{router.ready}/{router.wanted} routers ready"
    if router.ready >= router.wanted:
        return Condition(ROUTER, True, "RoutersReady", message)
    return Condition(ROUTER, False, "RoutersNotReady", message)


def _ready_condition(desired: int, ready: int, router: RouterObserved | None) -> Condition:
    if desired == 0:
        return Condition(
            READY,
            False,
            "ScaledToZero",
            "no replicas; a request the routers hold scales it up, as does a write to /scale",
        )
    if ready < desired:
        return Condition(READY, False, "ReplicasNotReady", f"{ready}/{desired} replicas ready")
    if router is not None and router.ready == 0:
        return Condition(
            READY,
            False,
            "RoutersNotReady",
            f"{ready}/{desired} replicas ready, but no router is: the Service has no endpoints",
        )
    return Condition(READY, True, "AllReplicasReady", f"{ready}/{desired} replicas ready")


def waiting_for_capacity(unschedulable: Sequence[PodProblem]) -> Condition:
    """Progressing, not failed: pods the scheduler cannot place yet are what makes a cluster
    autoscaler add nodes, after which they start."""
    first = unschedulable[0]
    count = len(unschedulable)
    pods = "1 pod waits" if count == 1 else f"{count} pods wait"
    return Condition(
        PROGRESSING,
        True,
        "WaitingForCapacity",
        f"{pods} for the cluster to add capacity; pod {first.pod}: {first.message}",
    )


def conditions_for(
    desired: int, observed: Observed, spec_error: str | None, error_reason: str = "InvalidSpec"
) -> list[Condition]:
    """`spec_error`: why the children could not be written (`error_reason`: InvalidSpec for a
    spec that cannot be served, Forbidden for a write the operator's RBAC does not allow)."""
    if spec_error is not None:
        return [
            Condition(READY, False, error_reason, spec_error),
            Condition(PROGRESSING, False, error_reason, spec_error),
            Condition(DEGRADED, True, error_reason, spec_error),
            Condition(ROUTER, False, error_reason, spec_error),
        ]
    deployment = observed.deployment or {}
    counts = deployment.get("status") or {}
    replicas = counts.get("replicas", 0)
    ready = counts.get("readyReplicas", 0)
    updated = counts.get("updatedReplicas", 0)
    router = observed.router
    problems = pod_problems([*observed.pods, *(router.pods if router is not None else ())])
    unschedulable = [p for p in problems if p.reason == UNSCHEDULABLE]
    failing = [p for p in problems if p.reason != UNSCHEDULABLE]
    stuck = next(
        (
            c
            for c in counts.get("conditions") or []
            if c.get("type") == "Progressing"
            and c.get("status") == "False"
            and c.get("reason") == "ProgressDeadlineExceeded"
        ),
        None,
    )

    if failing:
        degraded = Condition(
            DEGRADED, True, failing[0].reason, f"pod {failing[0].pod}: {failing[0].message}"
        )
    elif stuck is not None:
        degraded = Condition(
            DEGRADED,
            True,
            "ProgressDeadlineExceeded",
            stuck.get("message", "the rollout made no progress"),
        )
    else:
        degraded = Condition(DEGRADED, False, "AsExpected", "no failing pods")

    ready_condition = _ready_condition(desired, ready, router)

    if unschedulable:
        progressing = waiting_for_capacity(unschedulable)
    elif counts.get("observedGeneration", 0) < (deployment.get("metadata") or {}).get(
        "generation", 0
    ):
        # Until the Deployment controller has seen the latest template its counts are stale.
        progressing = Condition(
            PROGRESSING,
            True,
            "RollingUpdate",
            "the Deployment controller has not yet seen the latest template",
        )
    elif replicas > updated:
        progressing = Condition(
            PROGRESSING,
            True,
            "RollingUpdate",
            f"{updated}/{desired} replicas run the current template",
        )
    elif ready < desired:
        progressing = Condition(PROGRESSING, True, "ScalingUp", f"{ready}/{desired} replicas ready")
    elif replicas > desired:
        progressing = Condition(
            PROGRESSING, True, "ScalingDown", f"{replicas} replicas, {desired} wanted"
        )
    elif desired == 0:
        progressing = Condition(PROGRESSING, False, "ScaledToZero", "no replicas wanted")
    else:
        progressing = Condition(
            PROGRESSING, False, "Complete", "all replicas run the current template and are ready"
        )
    return [ready_condition, progressing, degraded, router_condition(router)]


def render_conditions(
    conditions: Sequence[Condition], previous: Sequence[Mapping[str, Any]], now: str
) -> list[dict[str, Any]]:
    """Conditions as the API stores them; lastTransitionTime moves only when status does."""
    earlier = {c.get("type"): c for c in previous}
    rendered = []
    for condition in conditions:
        status = "True" if condition.status else "False"
        before = earlier.get(condition.type)
        since = (
            before.get("lastTransitionTime") if before and before.get("status") == status else None
        )
        rendered.append(
            {
                "type": condition.type,
                "status": status,
                "reason": condition.reason,
                "message": condition.message,
                "lastTransitionTime": since or now,
            }
        )
    return rendered


def compute_status(
    *,
    generation: int,
    desired: int,
    url: str,
    selector: str,
    observed: Observed,
    previous: Mapping[str, Any],
    now: str,
    spec_error: str | None = None,
    error_reason: str = "InvalidSpec",
    adapters: Sequence[str] = (),
) -> dict[str, Any]:
    """`adapters`: the names of spec.adapters."""
    counts = (observed.deployment or {}).get("status") or {}
    conditions = conditions_for(desired, observed, spec_error, error_reason)
    return {
        "adapters": adapters_status(adapters, observed.served_adapters),
        "observedGeneration": generation,
        "replicas": counts.get("replicas", 0),
        "readyReplicas": counts.get("readyReplicas", 0),
        "updatedReplicas": counts.get("updatedReplicas", 0),
        "selector": selector,
        "url": url,
        "desiredReplicas": desired,
        "conditions": render_conditions(conditions, previous.get("conditions") or [], now),
    }


def newly_true(
    before: Sequence[Mapping[str, Any]], after: Sequence[Mapping[str, Any]], condition_type: str
) -> Mapping[str, Any] | None:
    """The condition if it just became True (or changed reason while True), for an Event."""
    old = next((c for c in before if c.get("type") == condition_type), None)
    new = next((c for c in after if c.get("type") == condition_type), None)
    if new is None or new.get("status") != "True":
        return None
    if old is not None and old.get("status") == "True" and old.get("reason") == new.get("reason"):
        return None
    return new
