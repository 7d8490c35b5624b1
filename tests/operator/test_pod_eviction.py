"""Evicting pods on the session's control plane, as node drains and the cluster-autoscaler do:
the Eviction API honours a PodDisruptionBudget whose status the real disruption controller
computes (429 while it allows nothing), and the built `kubectl drain` cordons the node and is
held back by the budget. The pods run on a Node of the test's, reported ready as a kubelet
would; they ask for no termination grace, so an evicted pod is gone at once."""

from __future__ import annotations

from typing import Any

import pytest

from pagedllm_testing.cluster.control_plane import ControlPlane
from pagedllm_testing.operator_harness import (
    Kube,
    Kubectl,
    KubeError,
    eventually,
    pods_path,
    report_running,
)

LABELS = {"app": "web"}


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane) -> ControlPlane:
    return control_plane


def run_ready_pod(kube: Kube, namespace: str, name: str, node: str, ip: str) -> None:
    spec: dict[str, Any] = {
        "nodeName": node,
        "terminationGracePeriodSeconds": 0,
        "containers": [{"name": "c", "image": "web:1"}],
    }
    kube.create(pods_path(namespace), {"metadata": {"name": name, "labels": LABELS}, "spec": spec})
    report_running(kube, namespace, name, ip=ip)


def create_budget(kube: Kube, namespace: str, min_available: int, healthy: int) -> None:
    """The budget, once the disruption controller has counted `healthy` pods for it."""
    path = f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets"
    kube.create(
        path,
        {
            "metadata": {"name": "web"},
            "spec": {"minAvailable": min_available, "selector": {"matchLabels": LABELS}},
        },
    )

    def counted() -> dict[str, Any] | None:
        budget = kube.get(f"{path}/web")
        status = (budget or {}).get("status") or {}
        done = status.get("observedGeneration") == budget["metadata"]["generation"]
        return status if done and status.get("currentHealthy") == healthy else None

    status = eventually(counted, timeout=30, what="the disruption controller's status")
    assert status["disruptionsAllowed"] == healthy - min_available


def evict(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    return kube.create(
        pods_path(namespace, name) + "/eviction",
        {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name}},
    )


def pod_names(kube: Kube, namespace: str) -> list[str]:
    return sorted(p["metadata"]["name"] for p in kube.list(pods_path(namespace)))


def test_eviction_honours_the_budget(kube: Kube, namespace: str, node: str) -> None:
    """minAvailable 2 of 3 ready pods: one eviction passes, the next is refused with 429 and
    the budget's reason until a replacement is ready."""
    for index, name in enumerate(("a", "b", "c")):
        run_ready_pod(kube, namespace, name, node, f"10.244.1.{index + 2}")
    create_budget(kube, namespace, min_available=2, healthy=3)

    assert evict(kube, namespace, "a")["status"] == "Success"
    assert kube.get(pods_path(namespace, "a")) is None
    with pytest.raises(KubeError) as refused:
        evict(kube, namespace, "b")
    assert refused.value.status == 429
    assert refused.value.body["reason"] == "TooManyRequests"
    (cause,) = refused.value.body["details"]["causes"]
    assert cause["reason"] == "DisruptionBudget"
    assert cause["message"] == "The disruption budget web needs 2 healthy pods and has 2 currently"
    assert kube.get(pods_path(namespace, "b")) is not None

    # A replacement gets ready: once the controller has counted it, b may go.
    run_ready_pod(kube, namespace, "d", node, "10.244.1.5")

    def evicted_b() -> bool:
        try:
            evict(kube, namespace, "b")
        except KubeError as error:
            assert error.status == 429, error
            return False
        return True

    eventually(evicted_b, timeout=30, what="the budget to allow b's eviction")
    assert pod_names(kube, namespace) == ["c", "d"]
    with pytest.raises(KubeError) as gone:
        evict(kube, namespace, "nope")
    assert gone.value.status == 404
    with pytest.raises(KubeError) as wrong_verb:
        kube.request("GET", pods_path(namespace, "c") + "/eviction")
    assert wrong_verb.value.status == 405


def test_kubectl_drain_is_held_by_the_budget(
    kube: Kube, kubectl: Kubectl, namespace: str, node: str
) -> None:
    """The built `kubectl drain`: it cordons the node, evicts through the API, and keeps
    retrying (then gives up at its timeout) while the budget allows no more."""
    for index, name in enumerate(("a", "b")):
        run_ready_pod(kube, namespace, name, node, f"10.244.2.{index + 2}")
    create_budget(kube, namespace, min_available=1, healthy=2)
    result = kubectl(
        "drain", node, "--pod-selector=app=web", "--force", "--timeout=4s", check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "Cannot evict pod as it would violate the pod's disruption budget" in output
    assert "global timeout reached: 4s" in output
    assert kube.get(f"/api/v1/nodes/{node}")["spec"]["unschedulable"] is True
    left = pod_names(kube, namespace)
    assert len(left) == 1, left  # one evicted, the other held by the budget
