"""A stand-in for kube-scheduler over nodes with a fixed number of GPU slots (test
infrastructure: the API emulator schedules nothing, and the kubelet stand-in runs only pods
bound to a node).

- Nodes are Node objects (`/api/v1/nodes`). A GPU node advertises `nvidia.com/gpu` in
  status.allocatable and carries the `nvidia.com/gpu` NoSchedule taint GPU node pools commonly
  have; the system node has no GPU and no taint.
- A pod takes the `nvidia.com/gpu` its containers request. The demo model's serving pods run on
  the CPU and request none, so the stand-in's SlotRule also counts pods with given labels as
  taking one GPU each: they play the GPU pods of a real cluster (which the operator gives the
  taint's toleration with their GPU request), and so do they here.
- Each unbound pod goes, through the `binding` subresource, to a fitting node: not cordoned,
  its taints tolerated, enough free GPUs (pods bound there and not finished hold theirs,
  terminating ones included). Of the fitting nodes the one with the most free GPUs wins (the
  real scheduler's default LeastAllocated scoring), then the name.
- A pod that fits nowhere stays Pending with PodScheduled=False, reason Unschedulable, and the
  real scheduler's message: `0/2 nodes are available: 1 Insufficient nvidia.com/gpu, 1
  node(s) were unschedulable.`

Not emulated: CPU and memory fit, affinity, node selectors, priorities and preemption.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from pagedllm.operator.kube import now_rfc3339
from pagedllm_testing.deployment_standin import is_terminating

GPU = "nvidia.com/gpu"
GPU_TAINT = {"key": GPU, "value": "present", "effect": "NoSchedule"}
NODE_GROUP_LABEL = "e2e.pagedllm.io/node-group"
UNSCHEDULABLE = "Unschedulable"
NODES = "/api/v1/nodes"


@dataclass(frozen=True)
class SlotRule:
    """Which pods take GPUs: what they request, or one for pods carrying `labels`."""

    resource: str = GPU
    labels: Mapping[str, str] = field(default_factory=dict)

    def slots(self, pod: Mapping[str, Any]) -> int:
        requested = 0
        for container in pod["spec"].get("containers") or []:
            resources = container.get("resources") or {}
            amount = (resources.get("limits") or {}).get(self.resource) or (
                resources.get("requests") or {}
            ).get(self.resource)
            requested += int(amount or 0)
        pod_labels = pod["metadata"].get("labels") or {}
        if not requested and self.labels and self.labels.items() <= pod_labels.items():
            return 1
        return requested


def node_manifest(name: str, gpus: int, group: str | None = None) -> tuple[dict, dict]:
    """A Node and its status (the status goes through /status, as the kubelet reports it)."""
    labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"}
    if group is not None:
        labels[NODE_GROUP_LABEL] = group
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": {"taints": [dict(GPU_TAINT)]} if gpus else {},
    }
    allocatable = {"cpu": "8", "memory": "32Gi", "pods": "110"}
    if gpus:
        allocatable[GPU] = str(gpus)
    status = {
        "capacity": dict(allocatable),
        "allocatable": allocatable,
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "message": "kubelet is posting ready status",
                "lastTransitionTime": now_rfc3339(),
            }
        ],
    }
    return node, {"status": status}


def node_gpus(node: Mapping[str, Any], resource: str = GPU) -> int:
    return int(((node.get("status") or {}).get("allocatable") or {}).get(resource, 0))


def is_finished(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def pods_on(node: str, pods: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The pods holding a node's resources: bound there and not finished (terminating too)."""
    return [p for p in pods if p["spec"].get("nodeName") == node and not is_finished(p)]


def free_gpus(node: Mapping[str, Any], pods: Sequence[Mapping[str, Any]], rule: SlotRule) -> int:
    used = sum(rule.slots(p) for p in pods_on(node["metadata"]["name"], pods))
    return node_gpus(node, rule.resource) - used


def tolerates(pod: Mapping[str, Any], taint: Mapping[str, Any], rule: SlotRule) -> bool:
    if taint.get("effect") not in ("NoSchedule", "NoExecute"):
        return True
    if taint.get("key") == rule.resource and rule.slots(pod) > 0:
        return True  # a GPU pod (see the module's docstring)
    for toleration in pod["spec"].get("tolerations") or []:
        if toleration.get("effect") not in (None, "", taint.get("effect")):
            continue
        if toleration.get("operator") == "Exists" and toleration.get("key") in (
            None,
            "",
            taint.get("key"),
        ):
            return True
        if toleration.get("key") == taint.get("key") and toleration.get("value") == taint.get(
            "value"
        ):
            return True
    return False


def _taint_text(taint: Mapping[str, Any]) -> str:
    return f"{{{taint.get('key')}: {taint.get('value', '')}}}"


@dataclass(frozen=True)
class Placement:
    node: str | None
    message: str = ""  # why no node fits


def place(
    pod: Mapping[str, Any],
    nodes: Sequence[Mapping[str, Any]],
    pods: Sequence[Mapping[str, Any]],
    rule: SlotRule,
) -> Placement:
    """The node the pod goes to, or the scheduler's explanation of why none fits (pure)."""
    wanted = rule.slots(pod)
    reasons: Counter[str] = Counter()
    fitting: list[tuple[int, str]] = []
    for node in nodes:
        name = node["metadata"]["name"]
        if (node.get("spec") or {}).get("unschedulable"):
            reasons["node(s) were unschedulable"] += 1
            continue
        untolerated = [
            t for t in (node.get("spec") or {}).get("taints") or [] if not tolerates(pod, t, rule)
        ]
        if untolerated:
            reasons[f"node(s) had untolerated taint {_taint_text(untolerated[0])}"] += 1
            continue
        free = free_gpus(node, pods, rule)
        if free < wanted:
            reasons[f"Insufficient {rule.resource}"] += 1
            continue
        fitting.append((-free, name))
    if fitting:
        return Placement(min(fitting)[1])
    parts = ", ".join(f"{count} {reason}" for reason, count in sorted(reasons.items()))
    return Placement(None, f"0/{len(nodes)} nodes are available: {parts}.")


def is_unschedulable(pod: Mapping[str, Any]) -> bool:
    return any(
        c.get("type") == "PodScheduled"
        and c.get("status") == "False"
        and c.get("reason") == UNSCHEDULABLE
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def _pending_status(pod: Mapping[str, Any], message: str) -> dict[str, Any] | None:
    """The status to write for an unschedulable pod, None when it already says so."""
    previous = next(
        (
            c
            for c in (pod.get("status") or {}).get("conditions") or []
            if c.get("type") == "PodScheduled"
        ),
        {},
    )
    if is_unschedulable(pod) and previous.get("message") == message:
        return None
    since = previous.get("lastTransitionTime") if previous.get("status") == "False" else None
    condition = {
        "type": "PodScheduled",
        "status": "False",
        "reason": UNSCHEDULABLE,
        "message": message,
        "lastProbeTime": None,
        "lastTransitionTime": since or now_rfc3339(),
    }
    return {"phase": "Pending", "conditions": [condition]}


class SchedulerStandin:
    """Binds the namespace's pods to nodes (REST calls to the API server at `server`)."""

    def __init__(self, http: httpx.AsyncClient, namespace: str, rule: SlotRule):
        self.http = http
        self.namespace = namespace
        self.rule = rule
        self.pods_path = f"/api/v1/namespaces/{namespace}/pods"

    async def sync(self) -> None:
        nodes = (await self.http.get(NODES)).raise_for_status().json()["items"]
        pods = (await self.http.get(self.pods_path)).raise_for_status().json()["items"]
        for pod in pods:
            if pod["spec"].get("nodeName") or is_terminating(pod) or is_finished(pod):
                continue
            name = pod["metadata"]["name"]
            placement = place(pod, nodes, pods, self.rule)
            if placement.node is not None:
                answer = await self.http.post(
                    f"{self.pods_path}/{name}/binding",
                    json={
                        "apiVersion": "v1",
                        "kind": "Binding",
                        "metadata": {"name": name},
                        "target": {"apiVersion": "v1", "kind": "Node", "name": placement.node},
                    },
                )
                if answer.status_code == 201:
                    # Counted against the node at once, for the pods after it in this pass.
                    pod["spec"]["nodeName"] = placement.node
                continue
            status = _pending_status(pod, placement.message)
            if status is not None:
                await self.http.patch(
                    f"{self.pods_path}/{name}/status",
                    json={"status": status},
                    headers={"Content-Type": "application/merge-patch+json"},
                )
