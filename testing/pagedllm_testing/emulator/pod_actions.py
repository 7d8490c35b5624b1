"""The pods' POST subresources: `binding` (the scheduler assigns a node) and `eviction` (a
deletion that the namespace's PodDisruptionBudgets may refuse with 429 TooManyRequests, which
is what `kubectl drain` and the cluster autoscaler use)."""

from __future__ import annotations

from typing import Any

from pagedllm_testing.emulator.disruption import budget, eviction_allowed, selects
from pagedllm_testing.emulator.errors import ApiError, bad_request, invalid
from pagedllm_testing.emulator.selectors import Selection
from pagedllm_testing.emulator.store import KubeEmulator

# The workloads whose replicas a budget counts (see disruption.expected_pods).
WORKLOAD_KINDS = (
    ("apps", "v1", "replicasets"),
    ("apps", "v1", "deployments"),
    ("apps", "v1", "statefulsets"),
)


def _success(name: str, kind: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success",
        "details": {"name": name, "kind": kind},
        "code": 201,
    }


def bind(em: KubeEmulator, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
    """A v1 Binding: sets the pod's spec.nodeName, once (it is immutable after)."""
    pods = em.find_type("", "v1", "pods")
    target = body.get("target") or {}
    node = target.get("name")
    if not isinstance(node, str) or not node:
        raise invalid(pods, name, [("target.name", "Required value")])
    if target.get("kind", "Node") != "Node":
        raise invalid(pods, name, [("target.kind", "must be Node")])
    em.get(em.find_type("", "v1", "nodes"), None, node)  # 404 for a node that is not there

    def assign(current: dict[str, Any]) -> dict[str, Any]:
        bound = current["spec"].get("nodeName")
        if bound:
            raise ApiError(409, "Conflict", f'pod {name} is already assigned to node "{bound}"', {})
        current["spec"]["nodeName"] = node
        return current

    em.update(pods, namespace, name, assign, subresource=None)
    return _success(name, "pods")


def evict(
    em: KubeEmulator, namespace: str, name: str, body: dict[str, Any], *, dry_run: bool = False
) -> dict[str, Any]:
    """A policy/v1 Eviction: the pod is deleted unless a budget that selects it allows no
    disruption now (429; the caller retries later, as kubectl drain does)."""
    pods_type = em.find_type("", "v1", "pods")
    if body.get("kind", "Eviction") != "Eviction":
        raise bad_request(f"expected an Eviction, got {body.get('kind')}")
    pod = em.get(pods_type, namespace, name)
    finished = (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")
    if not pod["metadata"].get("deletionTimestamp") and not finished:
        _check_budgets(em, namespace, pod)
    if not dry_run:
        em.delete(pods_type, namespace, name)
    return _success(name, "pods")


def _check_budgets(em: KubeEmulator, namespace: str, pod: dict[str, Any]) -> None:
    in_namespace = Selection(namespace, [], [])
    pdbs = [
        pdb
        for pdb in em.list(em.find_type("policy", "v1", "poddisruptionbudgets"), in_namespace)
        if selects(pdb, pod)
    ]
    if not pdbs:
        return
    if len(pdbs) > 1:
        raise ApiError(
            500,
            "InternalError",
            "This pod has more than one PodDisruptionBudget, which the eviction subresource "
            "does not support.",
        )
    (pdb,) = pdbs
    pods = em.list(em.find_type("", "v1", "pods"), in_namespace)
    owners = {
        obj["metadata"]["uid"]: obj
        for kind in WORKLOAD_KINDS
        if kind in em.types
        for obj in em.list(em.types[kind], in_namespace)
    }
    current = budget(pdb, pods, owners)
    if eviction_allowed(pdb, current, pod):
        return
    pdb_name = pdb["metadata"]["name"]
    raise ApiError(
        429,
        "TooManyRequests",
        "Cannot evict pod as it would violate the pod's disruption budget.",
        {
            "causes": [
                {
                    "reason": "DisruptionBudget",
                    "message": f"The disruption budget {pdb_name} needs "
                    f"{current.desired_healthy} healthy pods and has {current.healthy} "
                    "currently",
                }
            ]
        },
    )
