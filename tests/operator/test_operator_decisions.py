"""The pure decisions: autoscaler recommendations and status conditions."""

from __future__ import annotations

from typing import Any

from pagedllm.operator.autoscaler import AutoscalerState, decide, parse_prometheus_value
from pagedllm.operator.spec import AutoscalingSpec, Metric
from pagedllm.operator.status import (
    Observed,
    RouterObserved,
    compute_status,
    conditions_for,
    pod_problems,
)

SCALING = AutoscalingSpec(
    min_replicas=1,
    max_replicas=8,
    target=4,
    metric=Metric.INFLIGHT_REQUESTS,
    scale_down_delay_seconds=60,
)


def run(
    steps: list[tuple[float, int, list[float]]], scaling: AutoscalingSpec = SCALING
) -> list[int]:
    """Feed (time, ready pods, per-pod load) observations, replicas following decisions."""
    state, current, decided = AutoscalerState(), 2, []
    for now, ready, load in steps:
        decision, state = decide(
            state, current=current, ready=ready, per_pod=load, scaling=scaling, now=now
        )
        current = decision.replicas
        decided.append(current)
    return decided


def test_scales_up_at_once_to_total_load_over_target() -> None:
    assert run([(0, 2, [10, 12])]) == [6]


def test_small_deviation_within_tolerance_holds() -> None:
    assert run([(0, 2, [4.3, 4.2])]) == [2]


def test_bounds_hold() -> None:
    assert run([(0, 2, [100, 100])]) == [8]
    assert run([(0, 2, [0, 0]), (61, 2, [0, 0])]) == [2, 1]


def test_scale_down_waits_for_the_delay_and_takes_the_window_peak() -> None:
    steps = [
        (0, 2, [20, 20]),  # up to 10 -> capped at 8
        (10, 8, [4, 4, 4, 4, 4, 4, 4, 4]),
        (30, 8, [1] * 8),  # wants 2, but the last 60 s held 8
        (69, 8, [1] * 8),  # 8 was recommended at t=10: still inside
        (71, 8, [1] * 8),
    ]  # window now only has 2s
    assert run(steps) == [8, 8, 8, 8, 2]


def test_no_scale_down_before_a_full_window_was_observed() -> None:
    # A fresh operator (restarted) sees low load: it must watch a whole window first.
    assert run([(0, 2, [0, 0]), (30, 2, [0, 0]), (59, 2, [0, 0]), (60, 2, [0, 0])]) == [2, 2, 2, 1]


def test_pods_still_starting_do_not_count_as_idle() -> None:
    assert run([(0, 1, [0]), (100, 1, [0])]) == [2, 2]


def test_scale_to_zero_and_stay_without_metrics() -> None:
    zero = AutoscalingSpec(min_replicas=0, max_replicas=4, target=4, scale_down_delay_seconds=5)
    assert run([(0, 2, [0, 0]), (6, 2, [0, 0]), (20, 0, [])], zero) == [2, 0, 0]


def test_held_requests_wake_from_zero_and_hold_off_scale_to_zero() -> None:
    zero = AutoscalingSpec(min_replicas=0, max_replicas=4, target=4, scale_down_delay_seconds=5)
    state = AutoscalerState()
    # At zero: requests held by the routers are load; 9 of them at 4 per pod want 3.
    decision, state = decide(state, current=0, ready=0, per_pod=[], scaling=zero, now=0, held=9)
    assert decision.replicas == 3 and "9 requests held" in decision.explanation
    decision, state = decide(state, current=0, ready=0, per_pod=[], scaling=zero, now=0, held=1)
    assert decision.replicas == 1
    # Pods starting while requests wait: nothing moves.
    decision, state = decide(state, current=1, ready=0, per_pod=[], scaling=zero, now=1, held=1)
    assert decision.replicas == 1
    # An idle pod but a request still held somewhere: never down to zero.
    steps = [(t, [0.0], 1.0) for t in (2, 10, 20)] + [(21, [0.0], 0.0), (30, [0.0], 0.0)]
    replicas = []
    for now, per_pod, held in steps:
        decision, state = decide(
            state, current=1, ready=1, per_pod=per_pod, scaling=zero, now=now, held=held
        )
        replicas.append(decision.replicas)
    # Down only once a whole scaleDownDelaySeconds passed with nothing held.
    assert replicas == [1, 1, 1, 1, 0]


def test_held_requests_keep_one_replica_on_a_usage_metric() -> None:
    usage = AutoscalingSpec(
        min_replicas=0, max_replicas=4, target=0.8, metric=Metric.KV_CACHE_USAGE
    )
    decision, _ = decide(
        AutoscalerState(), current=0, ready=0, per_pod=[], scaling=usage, now=0, held=5
    )
    assert decision.replicas == 1


PROMETHEUS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="llama",engine="0"} 3.0
vllm:num_requests_running{model_name="llama",engine="1"} 2.0
vllm:num_requests_waiting{model_name="llama"} 7
vllm:kv_cache_usage_perc{model_name="llama"} 0.42
vllm:num_requests_running_total 99
"""


def test_prometheus_text() -> None:
    assert parse_prometheus_value(PROMETHEUS, "vllm:num_requests_running") == 5.0
    assert parse_prometheus_value(PROMETHEUS, "vllm:num_requests_waiting") == 7.0
    assert parse_prometheus_value(PROMETHEUS, "vllm:kv_cache_usage_perc") == 0.42
    assert parse_prometheus_value(PROMETHEUS, "vllm:absent") is None


def deployment(replicas: int, ready: int, updated: int, **extra: Any) -> dict[str, Any]:
    return {
        "metadata": {"generation": 1},
        "status": {
            "observedGeneration": 1,
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": updated,
            **extra,
        },
    }


def reasons(desired: int, observed: Observed, error: str | None = None) -> dict[str, str]:
    return {c.type: f"{c.status}/{c.reason}" for c in conditions_for(desired, observed, error)}


def test_conditions_through_a_rollout() -> None:
    assert reasons(2, Observed(None, [])) == {
        "Ready": "False/ReplicasNotReady",
        "Progressing": "True/ScalingUp",
        "Degraded": "False/AsExpected",
        "Router": "False/Disabled",
    }
    assert reasons(2, Observed(deployment(3, 2, 1), []))["Progressing"] == "True/RollingUpdate"
    assert reasons(2, Observed(deployment(3, 2, 1), []))["Ready"] == "True/AllReplicasReady"
    assert reasons(2, Observed(deployment(2, 2, 2), []))["Progressing"] == "False/Complete"
    # A template change the Deployment controller has not seen yet is a rollout in progress.
    unseen = {**deployment(2, 2, 2), "metadata": {"generation": 2}}
    assert reasons(2, Observed(unseen, []))["Progressing"] == "True/RollingUpdate"
    assert reasons(0, Observed(deployment(0, 0, 0), []))["Ready"] == "False/ScaledToZero"
    assert reasons(1, Observed(None, []), "bad")["Degraded"] == "True/InvalidSpec"
    stuck = deployment(
        1,
        0,
        1,
        conditions=[
            {
                "type": "Progressing",
                "status": "False",
                "reason": "ProgressDeadlineExceeded",
                "message": "timed out",
            }
        ],
    )
    assert reasons(1, Observed(stuck, []))["Degraded"] == "True/ProgressDeadlineExceeded"


def test_pod_problems() -> None:
    pods = [
        {
            "metadata": {"name": "a"},
            "status": {
                "initContainerStatuses": [
                    {
                        "name": "download",
                        "state": {
                            "waiting": {
                                "reason": "ImagePullBackOff",
                                "message": "pull access denied",
                            }
                        },
                    }
                ]
            },
        },
        {
            "metadata": {"name": "b", "deletionTimestamp": "2026-01-01T00:00:00Z"},
            "status": {
                "containerStatuses": [
                    {"name": "x", "state": {"waiting": {"reason": "CrashLoopBackOff"}}}
                ]
            },
        },
        {
            "metadata": {"name": "c"},
            "status": {
                "containerStatuses": [
                    {"name": "x", "state": {"waiting": {"reason": "ContainerCreating"}}}
                ]
            },
        },
    ]
    (problem,) = pod_problems(pods)
    assert problem.pod == "a" and problem.reason == "ImagePullBackOff"
    assert "download" in problem.message and "pull access denied" in problem.message


def test_transition_times_move_only_with_status() -> None:
    def status(ready: int, previous: dict[str, Any], now: str) -> dict[str, Any]:
        return compute_status(
            generation=3,
            desired=1,
            url="u",
            selector="s",
            observed=Observed(deployment(1, ready, 1), []),
            previous=previous,
            now=now,
        )

    first = status(0, {}, "T1")
    second = status(0, first, "T2")
    third = status(1, second, "T3")
    ready_times = [
        next(c["lastTransitionTime"] for c in s["conditions"] if c["type"] == "Ready")
        for s in (first, second, third)
    ]
    assert ready_times == ["T1", "T1", "T3"]
    assert third["observedGeneration"] == 3


def test_router_condition_and_readiness() -> None:
    def routers(ready: int, wanted: int = 2, pods: list[Any] | None = None) -> RouterObserved:
        return RouterObserved(wanted, deployment(wanted, ready, wanted), pods or [])

    serving = deployment(2, 2, 2)
    assert reasons(2, Observed(serving, [], routers(2)))["Router"] == "True/RoutersReady"
    partly = reasons(2, Observed(serving, [], routers(1)))
    # One router is enough to serve: Ready, but the Router condition says what is missing.
    assert (
        partly["Router"] == "False/RoutersNotReady" and partly["Ready"] == "True/AllReplicasReady"
    )
    none = reasons(2, Observed(serving, [], routers(0)))
    assert none["Ready"] == "False/RoutersNotReady"
    (ready,) = [
        c for c in conditions_for(2, Observed(serving, [], routers(0)), None) if c.type == "Ready"
    ]
    assert "no router is" in ready.message
    assert reasons(2, Observed(None, [], routers(0)))["Ready"] == "False/ReplicasNotReady"
    assert reasons(1, Observed(None, []), "bad")["Router"] == "False/InvalidSpec"
    crashing = {
        "metadata": {"name": "demo-router-x"},
        "status": {
            "containerStatuses": [
                {"name": "router", "state": {"waiting": {"reason": "CrashLoopBackOff"}}}
            ]
        },
    }
    degraded = conditions_for(2, Observed(serving, [], routers(1, pods=[crashing])), None)
    (condition,) = [c for c in degraded if c.type == "Degraded"]
    assert condition.status and "demo-router-x" in condition.message


def unschedulable_pod(name: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "status": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/1 nodes are available: 1 Insufficient nvidia.com/gpu.",
                }
            ],
        },
    }


def test_waiting_for_capacity_is_progress_not_failure() -> None:
    growing = deployment(3, 1, 3)
    waiting = Observed(growing, [unschedulable_pod("demo-b"), unschedulable_pod("demo-c")])
    assert reasons(3, waiting) == {
        "Ready": "False/ReplicasNotReady",
        "Progressing": "True/WaitingForCapacity",
        "Degraded": "False/AsExpected",
        "Router": "False/Disabled",
    }
    (progressing,) = [c for c in conditions_for(3, waiting, None) if c.type == "Progressing"]
    assert progressing.message.startswith("2 pods wait for the cluster to add capacity")
    assert "demo-b: 0/1 nodes are available: 1 Insufficient nvidia.com/gpu." in progressing.message
    one = conditions_for(3, Observed(growing, [unschedulable_pod("demo-c")]), None)
    assert next(c for c in one if c.type == "Progressing").message.startswith("1 pod waits")
    # Scheduled (the nodes came): back to plain scaling, then Complete once ready.
    assert reasons(3, Observed(growing, []))["Progressing"] == "True/ScalingUp"
    assert reasons(3, Observed(deployment(3, 3, 3), []))["Progressing"] == "False/Complete"
    # A pod being deleted waits for nothing.
    leaving = unschedulable_pod("demo-d")
    leaving["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert reasons(3, Observed(growing, [leaving]))["Progressing"] == "True/ScalingUp"
