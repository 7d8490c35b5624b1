"""The e2e's scheduler and cluster-autoscaler stand-ins: where pods fit and what the scheduler
says when they do not (pure), and both stand-ins against the API emulator: binding, scale-up
after the delay, and a drain through the Eviction API that a PodDisruptionBudget holds back."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pagedllm_testing.cluster_autoscaler_standin import (
    ClusterAutoscalerStandin,
    NodeGroup,
    Timers,
    nodes_to_add,
    unneeded,
)
from pagedllm_testing.emulator.running import EmulatorThread
from pagedllm_testing.operator_harness import Kube
from pagedllm_testing.scheduler_standin import SchedulerStandin, SlotRule, node_manifest, place

RULE = SlotRule(labels={"role": "serving"})
GROUP = NodeGroup("gpu", gpus_per_node=2, min_nodes=1, max_nodes=3)
TIMERS = Timers(scale_up_delay=5, scale_down_delay=5, eviction_retry=1)
NS = "default"
PODS = f"/api/v1/namespaces/{NS}/pods"


def node(name: str, gpus: int, group: str | None = "gpu", **spec: Any) -> dict[str, Any]:
    body, status = node_manifest(name, gpus, group)
    body["spec"].update(spec)
    return {**body, **status}


def pod(name: str, labels: dict[str, str] | None = None, on: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "c", "image": "i"}]}
    if on:
        spec["nodeName"] = on
    return {
        "metadata": {"name": name, "labels": {"role": "serving"} if labels is None else labels},
        "spec": spec,
    }


def test_slots_from_requests_or_labels() -> None:
    asking = pod("a", labels={})
    asking["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "2"}}
    assert RULE.slots(asking) == 2
    assert RULE.slots(pod("b")) == 1
    assert RULE.slots(pod("router", labels={"role": "router"})) == 0


def test_placement_and_the_schedulers_message() -> None:
    nodes = [node("system-0", 0, group=None), node("gpu-0", 1), node("gpu-1", 2)]
    # The most free GPUs wins; CPU pods stay off the tainted GPU nodes.
    assert place(pod("a"), nodes, [], RULE).node == "gpu-1"
    assert place(pod("r", labels={}), nodes, [], RULE).node == "system-0"
    full = [pod("x", on="gpu-0"), pod("y", on="gpu-1"), pod("z", on="gpu-1")]
    assert place(pod("a"), nodes, full, RULE).message == (
        "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    )
    cordoned = [node("system-0", 0, group=None), node("gpu-0", 1, unschedulable=True)]
    assert place(pod("a"), cordoned, [], RULE).message == (
        "0/2 nodes are available: 1 Insufficient nvidia.com/gpu, 1 node(s) were unschedulable."
    )
    only_gpu = [node("gpu-0", 1)]
    assert place(pod("r", labels={}), only_gpu, [], RULE).message == (
        "0/1 nodes are available: 1 node(s) had untolerated taint {nvidia.com/gpu: present}."
    )
    # A finished pod holds nothing; a terminating one still does.
    done = {**pod("x", on="gpu-0"), "status": {"phase": "Succeeded"}}
    assert place(pod("a"), only_gpu, [done], RULE).node == "gpu-0"
    leaving = pod("x", on="gpu-0")
    leaving["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert place(pod("a"), only_gpu, [leaving], RULE).node is None


def test_what_the_autoscaler_adds_and_removes() -> None:
    one = [node("gpu-0", 1)]
    waiting = [pod("b"), pod("c")]
    assert nodes_to_add(waiting, one, [pod("a", on="gpu-0")], GROUP, RULE) == 1
    assert nodes_to_add(waiting * 3, one, [pod("a", on="gpu-0")], GROUP, RULE) == 2  # max 3
    # A node just added with room for them: nothing more.
    assert nodes_to_add(waiting, [*one, node("gpu-1", 2)], [], GROUP, RULE) == 0

    nodes = [node("gpu-0", 1), node("gpu-1", 2), node("gpu-2", 2)]
    # gpu-2 is empty; gpu-0's pod fits beside gpu-1's; gpu-1's pod has nowhere to go.
    placed = [pod("a", on="gpu-0"), pod("b", on="gpu-1")]
    assert unneeded(nodes, placed, GROUP, RULE) == ["gpu-2", "gpu-0"]
    assert unneeded(nodes[:2], [*placed, pod("c", on="gpu-1")], GROUP, RULE) == []


@pytest.fixture
def emulator() -> Iterator[EmulatorThread]:
    with EmulatorThread() as running:
        yield running


def make_ready(kube: Kube, name: str) -> None:
    kube.merge(
        f"{PODS}/{name}/status",
        {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}},
    )


def test_scale_up_then_a_drain_held_by_the_budget(emulator: EmulatorThread) -> None:
    kube = Kube(emulator.url)
    for name, gpus, group in (("system-0", 0, None), ("gpu-0", 1, "gpu")):
        body, status = node_manifest(name, gpus, group)
        kube.create("/api/v1/nodes", body)
        kube.merge(f"/api/v1/nodes/{name}/status", status)
    for name in ("a", "b", "c"):
        kube.create(PODS, pod(name))
    kube.create(
        f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets",
        {
            "metadata": {"name": "serving"},
            "spec": {"minAvailable": 2, "selector": {"matchLabels": {"role": "serving"}}},
        },
    )

    def bound() -> dict[str, str | None]:
        return {p["metadata"]["name"]: p["spec"].get("nodeName") for p in kube.list(PODS)}

    async def scenario() -> ClusterAutoscalerStandin:
        async with httpx.AsyncClient(base_url=emulator.url, trust_env=False) as http:
            scheduler = SchedulerStandin(http, NS, RULE)
            autoscaler = ClusterAutoscalerStandin(http, NS, GROUP, TIMERS, RULE)
            await scheduler.sync()
            assert bound() == {"a": "gpu-0", "b": None, "c": None}
            (waiting,) = [p for p in kube.list(PODS) if p["metadata"]["name"] == "b"]
            (scheduled,) = waiting["status"]["conditions"]
            assert (scheduled["type"], scheduled["status"], scheduled["reason"]) == (
                "PodScheduled",
                "False",
                "Unschedulable",
            )
            assert scheduled["message"] == (
                "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
            )
            await autoscaler.tick(now=100)
            await autoscaler.tick(now=104)
            assert autoscaler.stats.added == []  # not before the delay
            await autoscaler.tick(now=105)
            assert autoscaler.stats.added == ["gpu-1"]
            await autoscaler.tick(now=106)
            assert autoscaler.stats.added == ["gpu-1"]  # the new node's room counts
            await scheduler.sync()
            assert bound() == {"a": "gpu-0", "b": "gpu-1", "c": "gpu-1"}
            for name in ("a", "b", "c"):
                make_ready(kube, name)

            # One replica goes: a's pod now fits beside the other on gpu-1.
            kube.request("DELETE", f"{PODS}/c")
            await autoscaler.tick(now=200)
            await autoscaler.tick(now=205)
            node = kube.get("/api/v1/nodes/gpu-0")
            assert node["spec"]["unschedulable"] is True
            # minAvailable 2 with 2 healthy pods: the budget refuses, the drain retries.
            await autoscaler.tick(now=205)
            await autoscaler.tick(now=206)
            assert autoscaler.stats.refused == 2 and autoscaler.stats.evicted == []
            assert "a" in bound()
            kube.create(PODS, pod("d"))  # the replacement the controller would make
            await scheduler.sync()
            assert bound()["d"] == "gpu-1"  # not on the cordoned node
            make_ready(kube, "d")
            await autoscaler.tick(now=207)
            assert autoscaler.stats.evicted == ["a"] and "a" not in bound()
            await autoscaler.tick(now=208)
            assert autoscaler.stats.drained == ["gpu-0"]
            assert kube.get("/api/v1/nodes/gpu-0") is None
            # gpu-1 is now the group's only node: its minimum, kept though half empty.
            await autoscaler.tick(now=300)
            await autoscaler.tick(now=310)
            assert autoscaler.stats.removed == ["gpu-0"]
            return autoscaler

    asyncio.run(scenario())
