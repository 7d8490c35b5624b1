"""The e2e's cluster autoscaler stand-in (cluster_autoscaler_standin.py), its arithmetic: which
pods wait for GPUs, how many nodes they need, and which nodes the cluster could do without.
(It adds and drains real nodes of the test cluster in e2e/test_scenario.py.)"""

from __future__ import annotations

from typing import Any

from pagedllm_testing.cluster.kubelet.node import GPU, NODE_GROUP_LABEL
from pagedllm_testing.cluster_autoscaler_standin import (
    NodeGroup,
    gpus_of,
    nodes_to_add,
    unneeded,
    waiting_for_capacity,
)

GROUP = NodeGroup("gpu", gpus_per_node=2, min_nodes=1, max_nodes=3)


def node(name: str, gpus: int, group: str | None = "gpu", **spec: Any) -> dict[str, Any]:
    labels = {NODE_GROUP_LABEL: group} if group else {}
    return {
        "metadata": {"name": name, "labels": labels},
        "spec": spec,
        "status": {"allocatable": {GPU: str(gpus)}},
    }


def pod(name: str, gpus: int = 1, on: str | None = None, **status: Any) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "c", "image": "i"}
    if gpus:
        container["resources"] = {"limits": {GPU: str(gpus)}}
    spec: dict[str, Any] = {"containers": [container]}
    if on:
        spec["nodeName"] = on
    return {"metadata": {"name": name, "namespace": "ns"}, "spec": spec, "status": status}


def unschedulable(name: str, gpus: int = 1) -> dict[str, Any]:
    condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
    return pod(name, gpus, conditions=[condition])


def test_gpus_are_what_the_containers_request() -> None:
    asking = pod("a", 2)
    assert gpus_of(asking) == 2
    asking["spec"]["containers"][0]["resources"] = {"requests": {GPU: 1}, "limits": {GPU: 1}}
    assert gpus_of(asking) == 1
    assert gpus_of(pod("router", 0)) == 0


def test_only_unschedulable_gpu_pods_wait_for_capacity() -> None:
    pending = pod("p")  # not judged by the scheduler yet
    placed = pod("q", on="gpu-0")
    cpu = unschedulable("r", 0)
    assert [
        p["metadata"]["name"]
        for p in waiting_for_capacity([unschedulable("w"), pending, placed, cpu])
    ] == ["w"]


def test_what_the_autoscaler_adds_and_removes() -> None:
    one = [node("gpu-0", 1)]
    waiting = [unschedulable("b"), unschedulable("c")]
    assert nodes_to_add(waiting, one, [pod("a", on="gpu-0")], GROUP) == 1
    assert nodes_to_add(waiting * 3, one, [pod("a", on="gpu-0")], GROUP) == 2  # max 3
    # A node just added with room for them: nothing more.
    assert nodes_to_add(waiting, [*one, node("gpu-1", 2)], [], GROUP) == 0
    # Other groups' nodes and cordoned ones offer no room.
    assert nodes_to_add(waiting, [node("system-0", 4, group=None)], [], GROUP) == 1
    assert nodes_to_add(waiting, [node("gpu-1", 2, unschedulable=True)], [], GROUP) == 1

    nodes = [node("gpu-0", 1), node("gpu-1", 2), node("gpu-2", 2)]
    # gpu-2 is empty; gpu-0's pod fits beside gpu-1's; gpu-1's pod has nowhere to go.
    placed = [pod("a", on="gpu-0"), pod("b", on="gpu-1")]
    assert unneeded(nodes, placed, GROUP) == ["gpu-2", "gpu-0"]
    assert unneeded(nodes[:2], [*placed, pod("c", on="gpu-1")], GROUP) == []
    # A finished pod holds nothing; a terminating one still does (its node is not judged).
    done = pod("x", on="gpu-2", phase="Succeeded")
    assert "gpu-2" in unneeded(nodes, [*placed, done], GROUP)
    leaving = pod("y", on="gpu-0")
    leaving["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert "gpu-0" not in unneeded(nodes, [pod("b", on="gpu-1"), leaving], GROUP)
