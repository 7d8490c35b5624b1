"""The emulator's pod eviction (PodDisruptionBudgets honoured, 429 when they allow nothing)
and binding, through its REST API and through the real `kubectl drain`; and the budget
arithmetic itself."""

from __future__ import annotations

from typing import Any

import pytest

from pagedllm_testing.emulator.disruption import Budget, budget, eviction_allowed
from pagedllm_testing.operator_harness import Kube, Kubectl, KubeError

OWNER_UID = "rs-uid"


def pod(name: str, ready: bool = True, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "labels": labels or {"app": "web"},
            "ownerReferences": [{"uid": OWNER_UID, "controller": True, "kind": "ReplicaSet"}],
        },
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def pdb(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {"name": "web", "namespace": "ns"},
        "spec": {"selector": {"matchLabels": {"app": "web"}}, **spec},
    }


def replica_set(replicas: int, deployment: int | None = None) -> dict[str, Any]:
    """The pods' ReplicaSet, owned by a Deployment of `deployment` replicas if given."""
    owners: dict[str, Any] = {
        OWNER_UID: {
            "kind": "ReplicaSet",
            "metadata": {
                "uid": OWNER_UID,
                "ownerReferences": [{"uid": "d-uid", "controller": True, "kind": "Deployment"}]
                if deployment is not None
                else [],
            },
            "spec": {"replicas": replicas},
        }
    }
    if deployment is not None:
        owners["d-uid"] = {
            "kind": "Deployment",
            "metadata": {"uid": "d-uid"},
            "spec": {"replicas": deployment},
        }
    return owners


def test_max_unavailable_counts_the_controllers_replicas() -> None:
    pods = [pod("a"), pod("b"), pod("c")]
    three = budget(pdb({"maxUnavailable": 1}), pods, replica_set(3))
    assert three == Budget(expected=3, desired_healthy=2, healthy=3)
    assert three.disruptions_allowed == 1
    # One pod already gone (being replaced): the budget is spent.
    spent = budget(pdb({"maxUnavailable": 1}), [pod("a"), pod("b")], replica_set(3))
    assert spent.disruptions_allowed == 0
    # A rollout's ReplicaSet counts as its Deployment.
    assert budget(pdb({"maxUnavailable": 1}), pods, replica_set(1, deployment=3)).expected == 3
    # Percentages are rounded up, for both fields.
    assert budget(pdb({"maxUnavailable": "50%"}), pods, replica_set(3)).desired_healthy == 1
    assert budget(pdb({"minAvailable": "50%"}), pods, replica_set(3)).desired_healthy == 2


def test_min_available_and_the_other_pods() -> None:
    pods = [pod("a"), pod("b", ready=False), pod("other", labels={"app": "db"})]
    counted = budget(pdb({"minAvailable": 1}), pods, replica_set(5))
    # An integer minAvailable counts the pods there are, not the controller's replicas.
    assert counted == Budget(expected=2, desired_healthy=1, healthy=1)
    assert counted.disruptions_allowed == 0
    # Terminating pods are not healthy.
    leaving = pod("a")
    leaving["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert budget(pdb({"minAvailable": 1}), [leaving], replica_set(1)).healthy == 0


def test_unhealthy_pods_by_policy() -> None:
    sick = pod("b", ready=False)
    spent = Budget(expected=2, desired_healthy=2, healthy=1)
    assert not eviction_allowed(pdb({"maxUnavailable": 0}), spent, pod("a"))
    assert not eviction_allowed(pdb({"maxUnavailable": 0}), spent, sick)
    always = pdb({"maxUnavailable": 0, "unhealthyPodEvictionPolicy": "AlwaysAllow"})
    assert eviction_allowed(always, spent, sick)
    met = Budget(expected=2, desired_healthy=1, healthy=1)
    assert eviction_allowed(pdb({"maxUnavailable": 1}), met, sick)
    assert not eviction_allowed(pdb({"maxUnavailable": 1}), met, pod("a"))


# --- through the API ---------------------------------------------------------------------


def pods_path(namespace: str) -> str:
    return f"/api/v1/namespaces/{namespace}/pods"


def make_ready_pod(kube: Kube, namespace: str, name: str, node: str | None = None) -> None:
    spec: dict[str, Any] = {"containers": [{"name": "c", "image": "i"}]}
    if node is not None:
        spec["nodeName"] = node
    kube.create(
        pods_path(namespace), {"metadata": {"name": name, "labels": {"app": "web"}}, "spec": spec}
    )
    kube.merge(
        f"{pods_path(namespace)}/{name}/status",
        {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}},
    )


def evict(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    return kube.create(
        f"{pods_path(namespace)}/{name}/eviction",
        {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name}},
    )


def test_eviction_honours_the_budget(kube: Kube, namespace: str) -> None:
    for name in ("a", "b", "c"):
        make_ready_pod(kube, namespace, name)
    kube.create(
        f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets",
        {
            "metadata": {"name": "web"},
            "spec": {"minAvailable": 2, "selector": pdb({})["spec"]["selector"]},
        },
    )
    assert evict(kube, namespace, "a")["status"] == "Success"
    assert kube.get(f"{pods_path(namespace)}/a") is None
    with pytest.raises(KubeError) as refused:
        evict(kube, namespace, "b")
    assert refused.value.status == 429
    assert refused.value.body["reason"] == "TooManyRequests"
    cause = refused.value.body["details"]["causes"][0]
    assert cause["reason"] == "DisruptionBudget"
    assert "needs 2 healthy pods and has 2 currently" in cause["message"]
    assert kube.get(f"{pods_path(namespace)}/b") is not None
    # A replacement gets ready: the next eviction is allowed.
    make_ready_pod(kube, namespace, "d")
    evict(kube, namespace, "b")
    assert sorted(p["metadata"]["name"] for p in kube.list(pods_path(namespace))) == ["c", "d"]
    with pytest.raises(KubeError) as gone:
        evict(kube, namespace, "nope")
    assert gone.value.status == 404
    with pytest.raises(KubeError) as wrong_verb:
        kube.request("GET", f"{pods_path(namespace)}/c/eviction")
    assert wrong_verb.value.status == 405


def test_binding_assigns_a_node_once(kube: Kube, namespace: str) -> None:
    kube.create("/api/v1/nodes", {"metadata": {"name": f"node-{namespace}"}})
    kube.create(
        pods_path(namespace),
        {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "i"}]}},
    )
    binding = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": "p"},
        "target": {"apiVersion": "v1", "kind": "Node", "name": f"node-{namespace}"},
    }
    kube.create(f"{pods_path(namespace)}/p/binding", binding)
    assert kube.get(f"{pods_path(namespace)}/p")["spec"]["nodeName"] == f"node-{namespace}"
    with pytest.raises(KubeError) as again:
        kube.create(f"{pods_path(namespace)}/p/binding", binding)
    assert again.value.status == 409
    missing = {**binding, "target": {"kind": "Node", "name": "no-such-node"}}
    with pytest.raises(KubeError) as no_node:
        kube.create(f"{pods_path(namespace)}/p/binding", missing)
    assert no_node.value.status == 404


def test_kubectl_drain_is_held_by_the_budget(kube: Kube, kubectl: Kubectl, namespace: str) -> None:
    """The real `kubectl drain`: it cordons the node, evicts through the API, and keeps
    retrying (then gives up at its timeout) while the budget allows no more."""
    node = f"drain-{namespace}"
    kube.create("/api/v1/nodes", {"metadata": {"name": node}})
    for name in ("a", "b"):
        make_ready_pod(kube, namespace, name, node=node)
    kube.create(
        f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets",
        {
            "metadata": {"name": "web"},
            "spec": {"minAvailable": 1, "selector": pdb({})["spec"]["selector"]},
        },
    )
    result = kubectl(
        "drain", node, "--pod-selector=app=web", "--force", "--timeout=4s", check=False
    )
    assert result.returncode != 0
    assert "disruption budget" in result.stdout + result.stderr
    assert kube.get(f"/api/v1/nodes/{node}")["spec"]["unschedulable"] is True
    left = [p["metadata"]["name"] for p in kube.list(pods_path(namespace))]
    assert len(left) == 1, left  # one evicted, the other held by the budget
