"""A stand-in for the cluster autoscaler (test infrastructure), over one node group of GPU
nodes of the test cluster: a node it adds is a process kubelet started for a new Node (as a
cloud instance's kubelet registers), one it removes has its kubelet stopped and its Node
deleted. The real kube-scheduler decides where pods fit; this stand-in reads its verdict.

- Scale-up: once a pod that requests GPUs (`nvidia.com/gpu`) has been Unschedulable for
  `scale_up_delay` seconds, it adds as many nodes of the group's size as the waiting pods need
  beyond the free GPUs of the group's schedulable nodes (the nodes it just added count, so it
  does not add twice), up to `max_nodes`.
- Scale-down, only while nothing waits for capacity: a node is unneeded when it is empty, or
  when every pod on it fits into the free GPUs of the other non-empty nodes (that is where
  the pods' controllers' replacements will be scheduled). After `scale_down_delay` seconds
  unneeded, empty nodes are removed; otherwise one node is drained: cordoned (unschedulable
  and the ToBeDeletedByClusterAutoscaler taint), its pods evicted one at a time through the
  Eviction API (policy/v1), a 429 (a PodDisruptionBudget allows no disruption now) retried
  every `eviction_retry` seconds, and once no pod is left on it (the evicted ones have
  terminated gracefully) it is removed. Never below `min_nodes`; one drain at a time.

`tick()` is one pass; `stats` records what it did.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from pagedllm_testing.cluster.kubelet.node import GPU, NODE_GROUP_LABEL, NodeSpec

NODES = "/api/v1/nodes"
TO_BE_DELETED_TAINT = {"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}
MERGE_PATCH = {"Content-Type": "application/merge-patch+json"}


class NodeHost(Protocol):
    """Where nodes come from: the test cluster. `add_node` returns once the node is registered
    and Ready, `remove_node` once it is gone."""

    def add_node(self, node: NodeSpec) -> None: ...

    def remove_node(self, name: str) -> None: ...


def is_terminating(obj: Mapping[str, Any]) -> bool:
    return bool(obj["metadata"].get("deletionTimestamp"))


def is_unschedulable(pod: Mapping[str, Any]) -> bool:
    return any(
        c.get("type") == "PodScheduled"
        and c.get("status") == "False"
        and c.get("reason") == "Unschedulable"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def gpus_of(pod: Mapping[str, Any]) -> int:
    """The GPUs a pod's containers request (a limit alone is the request too)."""
    total = 0
    for container in pod["spec"].get("containers") or []:
        resources = container.get("resources") or {}
        amount = (resources.get("requests") or {}).get(GPU) or (resources.get("limits") or {}).get(
            GPU
        )
        total += int(amount or 0)
    return total


def node_gpus(node: Mapping[str, Any]) -> int:
    return int(((node.get("status") or {}).get("allocatable") or {}).get(GPU, 0))


def is_finished(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def pods_on(node: str, pods: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The pods holding a node's resources: bound there and not finished (terminating too)."""
    return [p for p in pods if p["spec"].get("nodeName") == node and not is_finished(p)]


def free_gpus(node: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> int:
    return node_gpus(node) - sum(gpus_of(p) for p in pods_on(node["metadata"]["name"], pods))


@dataclass(frozen=True)
class NodeGroup:
    name: str
    gpus_per_node: int
    min_nodes: int
    max_nodes: int


@dataclass(frozen=True)
class Timers:
    scale_up_delay: float
    scale_down_delay: float
    eviction_retry: float = 1.0


@dataclass
class AutoscalerStats:
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    drained: list[str] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)
    # Evictions a PodDisruptionBudget refused (429), each retried.
    refused: int = 0


@dataclass
class Drain:
    node: str
    queue: list[tuple[str, str]]  # (namespace, name) of the pods left to evict
    next_attempt: float = 0.0


def in_group(node: Mapping[str, Any], group: NodeGroup) -> bool:
    return (node["metadata"].get("labels") or {}).get(NODE_GROUP_LABEL) == group.name


def is_cordoned(node: Mapping[str, Any]) -> bool:
    return bool((node.get("spec") or {}).get("unschedulable"))


def waiting_for_capacity(pods: Sequence[Mapping[str, Any]]) -> list[Mapping]:
    """Pods the scheduler could not place that need GPUs."""
    return [
        p
        for p in pods
        if not p["spec"].get("nodeName")
        and not is_terminating(p)
        and is_unschedulable(p)
        and gpus_of(p) > 0
    ]


def nodes_to_add(
    waiting: Sequence[Mapping[str, Any]],
    nodes: Sequence[Mapping[str, Any]],
    pods: Sequence[Mapping[str, Any]],
    group: NodeGroup,
) -> int:
    """How many of the group's nodes the waiting pods need (pure)."""
    ours = [n for n in nodes if in_group(n, group)]
    free = sum(max(free_gpus(n, pods), 0) for n in ours if not is_cordoned(n))
    missing = sum(gpus_of(p) for p in waiting) - free
    if missing <= 0:
        return 0
    wanted = math.ceil(missing / group.gpus_per_node)
    return max(min(wanted, group.max_nodes - len(ours)), 0)


def unneeded(
    nodes: Sequence[Mapping[str, Any]],
    pods: Sequence[Mapping[str, Any]],
    group: NodeGroup,
) -> list[str]:
    """The group's nodes the cluster could do without now, empty ones first (pure)."""
    ours = [n for n in nodes if in_group(n, group) and not is_cordoned(n)]
    empty = [n["metadata"]["name"] for n in ours if not pods_on(n["metadata"]["name"], pods)]
    movable = []
    for node in ours:
        name = node["metadata"]["name"]
        here = pods_on(name, pods)
        if not here or any(is_terminating(p) for p in here):
            continue
        room = {
            other["metadata"]["name"]: free_gpus(other, pods)
            for other in ours
            if other["metadata"]["name"] not in empty and other["metadata"]["name"] != name
        }
        fits = True
        for pod in sorted(here, key=gpus_of, reverse=True):
            target = next((n for n, free in room.items() if free >= gpus_of(pod)), None)
            if target is None:
                fits = False
                break
            room[target] -= gpus_of(pod)
        if fits:
            movable.append((len(here), name))
    return [*empty, *(name for _, name in sorted(movable))]


class ClusterAutoscalerStandin:
    def __init__(
        self,
        http: httpx.AsyncClient,
        host: NodeHost,
        group: NodeGroup,
        timers: Timers,
    ):
        self.http = http
        self.host = host
        self.pods_path = "/api/v1/pods"
        self.group = group
        self.timers = timers
        self.stats = AutoscalerStats()
        self.drain: Drain | None = None
        self._waiting_since: dict[str, float] = {}
        self._unneeded_since: dict[str, float] = {}
        self._next_index = 0

    async def tick(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        nodes = (await self.http.get(NODES)).raise_for_status().json()["items"]
        pods = (await self.http.get(self.pods_path)).raise_for_status().json()["items"]
        waiting = waiting_for_capacity(pods)
        added = await self._scale_up(waiting, nodes, pods, now)
        if self.drain is not None:
            await self._continue_drain(self.drain, pods, now)
        elif waiting or added:
            self._unneeded_since.clear()  # no scale-down while scaling up
        else:
            await self._scale_down(nodes, pods, now)

    async def _scale_up(
        self,
        waiting: Sequence[Mapping[str, Any]],
        nodes: Sequence[Mapping[str, Any]],
        pods: Sequence[Mapping[str, Any]],
        now: float,
    ) -> bool:
        uids = {p["metadata"]["uid"] for p in waiting}
        self._waiting_since = {
            uid: self._waiting_since.get(uid, now) for uid in uids
        }  # forget the pods placed or gone
        due = [
            p
            for p in waiting
            if now - self._waiting_since[p["metadata"]["uid"]] >= self.timers.scale_up_delay
        ]
        if not due:
            return False
        count = nodes_to_add(waiting, nodes, pods, self.group)
        taken = {n["metadata"]["name"] for n in nodes} | set(self.stats.removed)
        for _ in range(count):
            # A new name each time, as a cloud's instances get: never one a removed node had.
            while f"{self.group.name}-{self._next_index}" in taken:
                self._next_index += 1
            name = f"{self.group.name}-{self._next_index}"
            self._next_index += 1
            spec = NodeSpec(name, self.group.gpus_per_node, {NODE_GROUP_LABEL: self.group.name})
            await asyncio.to_thread(self.host.add_node, spec)
            self.stats.added.append(name)
        return count > 0

    async def _scale_down(
        self, nodes: Sequence[Mapping[str, Any]], pods: Sequence[Mapping[str, Any]], now: float
    ) -> None:
        candidates = unneeded(nodes, pods, self.group)
        self._unneeded_since = {n: self._unneeded_since.get(n, now) for n in candidates}
        ripe = [
            n for n in candidates if now - self._unneeded_since[n] >= self.timers.scale_down_delay
        ]
        room = sum(1 for n in nodes if in_group(n, self.group)) - self.group.min_nodes
        for name in ripe[: max(room, 0)]:
            if pods_on(name, pods):
                await self._start_drain(name, pods, now)
                return  # one drain at a time, and the other nodes judged again after it
            await self._delete_node(name)

    async def _start_drain(self, name: str, pods: Sequence[Mapping[str, Any]], now: float) -> None:
        node = (await self.http.get(f"{NODES}/{name}")).raise_for_status().json()
        taints = [*((node.get("spec") or {}).get("taints") or []), dict(TO_BE_DELETED_TAINT)]
        (
            await self.http.patch(
                f"{NODES}/{name}",
                json={"spec": {"unschedulable": True, "taints": taints}},
                headers=MERGE_PATCH,
            )
        ).raise_for_status()
        queue = [
            (p["metadata"]["namespace"], p["metadata"]["name"])
            for p in pods_on(name, pods)
            if not is_terminating(p)
        ]
        self.drain = Drain(name, queue, now)

    async def _continue_drain(
        self, drain: Drain, pods: Sequence[Mapping[str, Any]], now: float
    ) -> None:
        if drain.queue:
            if now < drain.next_attempt:
                return
            pod = drain.queue[0]
            namespace, name = pod
            answer = await self.http.post(
                f"/api/v1/namespaces/{namespace}/pods/{name}/eviction",
                json={
                    "apiVersion": "policy/v1",
                    "kind": "Eviction",
                    "metadata": {"name": name, "namespace": namespace},
                },
            )
            if answer.status_code == 429:
                self.stats.refused += 1
                drain.next_attempt = now + self.timers.eviction_retry
                return
            if answer.status_code not in (200, 201, 404):
                answer.raise_for_status()
            if answer.status_code != 404:
                self.stats.evicted.append(name)
            drain.queue.pop(0)
            return
        if not pods_on(drain.node, pods):
            await self._delete_node(drain.node)
            self.stats.drained.append(drain.node)
            self.drain = None

    async def _delete_node(self, name: str) -> None:
        await asyncio.to_thread(self.host.remove_node, name)
        self.stats.removed.append(name)
        self._unneeded_since.pop(name, None)
