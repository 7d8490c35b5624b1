"""The Node a kubelet registers and keeps alive: the object (labels, GPU taint), its status
(capacity, allocatable, addresses, conditions, nodeInfo), and the Lease in kube-node-lease
that the node lifecycle controller reads as the node's heartbeat."""

from __future__ import annotations

import datetime
import platform
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

GPU = "nvidia.com/gpu"
GPU_TAINT = {"key": GPU, "value": "present", "effect": "NoSchedule"}
NODE_GROUP_LABEL = "e2e.pagedllm.io/node-group"
LEASE_NAMESPACE = "kube-node-lease"
LEASE_SECONDS = 40
# What each node advertises, whatever the machine has: the scheduler places pods by it, and the
# pods all share this machine's CPUs and memory.
CPUS = "8"
MEMORY = "32Gi"
PODS = "110"


def now(micro: bool = False) -> str:
    moment = datetime.datetime.now(datetime.timezone.utc)
    if micro:
        return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class NodeSpec:
    """A node of the test cluster: its name, GPUs (a GPU node's pods run on the CPU here; it
    advertises ``nvidia.com/gpu`` and carries the taint GPU node pools have) and labels."""

    name: str
    gpus: int = 0
    labels: Mapping[str, str] = field(default_factory=dict)
    # Taint keys (NoSchedule) besides a GPU node's own.
    taints: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "gpus": self.gpus,
            "labels": dict(self.labels),
            "taints": list(self.taints),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NodeSpec:
        return cls(
            str(data["name"]),
            int(data.get("gpus", 0)),
            dict(data.get("labels") or {}),
            tuple(data.get("taints") or ()),
        )


SYSTEM_NODE = "system-0"
GPU_GROUP = "gpu"


def cluster_nodes(gpu_nodes: int, gpus_per_node: int = 1) -> list[NodeSpec]:
    """A test cluster's nodes: a system node (no GPU: the operator, the routers) and GPU nodes
    of one node group (the serving pods; the cluster autoscaler stand-in's group)."""
    gpu = [
        NodeSpec(f"{GPU_GROUP}-{index}", gpus_per_node, {NODE_GROUP_LABEL: GPU_GROUP})
        for index in range(gpu_nodes)
    ]
    return [NodeSpec(SYSTEM_NODE), *gpu]


def node_object(spec: NodeSpec) -> dict[str, Any]:
    taints = [dict(GPU_TAINT)] if spec.gpus else []
    taints += [{"key": key, "effect": "NoSchedule"} for key in spec.taints]
    labels = {
        "kubernetes.io/hostname": spec.name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        **spec.labels,
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": spec.name, "labels": labels},
        "spec": {"taints": taints} if taints else {},
    }


def node_status(spec: NodeSpec, address: str, version: str, since: str) -> dict[str, Any]:
    resources = {"cpu": CPUS, "memory": MEMORY, "pods": PODS, "ephemeral-storage": "100Gi"}
    if spec.gpus:
        resources[GPU] = str(spec.gpus)
    heartbeat = now()

    def condition(kind: str, status: str, reason: str, message: str) -> dict[str, str]:
        return {
            "type": kind,
            "status": status,
            "reason": reason,
            "message": message,
            "lastHeartbeatTime": heartbeat,
            "lastTransitionTime": since,
        }

    return {
        "capacity": resources,
        "allocatable": dict(resources),
        "addresses": [
            {"type": "InternalIP", "address": address},
            {"type": "Hostname", "address": spec.name},
        ],
        "conditions": [
            condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "ok"),
            condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "ok"),
            condition("PIDPressure", "False", "KubeletHasSufficientPID", "ok"),
            condition("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
        ],
        "nodeInfo": {
            "machineID": spec.name,
            "systemUUID": spec.name,
            "bootID": spec.name,
            "kernelVersion": platform.release(),
            "osImage": "pagedllm process kubelet (stand-in)",
            "containerRuntimeVersion": "process://1",
            "kubeletVersion": version,
            "kubeProxyVersion": "",
            "operatingSystem": "linux",
            "architecture": "amd64",
        },
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
    }


def lease_object(name: str, renew: str) -> dict[str, Any]:
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": name, "namespace": LEASE_NAMESPACE},
        "spec": {
            "holderIdentity": name,
            "leaseDurationSeconds": LEASE_SECONDS,
            "renewTime": renew,
        },
    }
