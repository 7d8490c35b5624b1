"""A stand-in for kube-controller-manager's Deployment and ReplicaSet controllers (test
infrastructure: the API emulator runs no controllers).

Like the real ones, it keeps one ReplicaSet per pod template (named DEPLOYMENT-HASH, with the
`pod-template-hash` label), scales them by the Deployment's strategy and creates or deletes
pods to match each ReplicaSet's replicas, then reports the Deployment's status (replicas,
updatedReplicas, readyReplicas, availableReplicas, observedGeneration, the Available and
Progressing conditions).

RollingUpdate follows the real controller's arithmetic: the new ReplicaSet grows while all
pods number at most replicas + maxSurge; old ones shrink only while at least replicas -
maxUnavailable pods stay available. Recreate stops every old pod before the new ones start.
minReadySeconds is taken as 0 (ready is available) and there is no progress deadline.
"""

from __future__ import annotations

import hashlib
import json
import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagedllm.operator.kube import KubeClient

POD_TEMPLATE_HASH = "pod-template-hash"
REVISION_ANNOTATION = "deployment.kubernetes.io/revision"
# The emulator deletes objects at once; a finalizer held by the kubelet stand-in gives pods
# the graceful deletion a real API server gives them (Terminating until the kubelet is done).
KUBELET_FINALIZER = "e2e.pagedllm.io/kubelet-standin"


def is_terminating(obj: Mapping[str, Any]) -> bool:
    return bool(obj["metadata"].get("deletionTimestamp"))


def is_pod_ready(pod: Mapping[str, Any]) -> bool:
    if is_terminating(pod):
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def owned_by(obj: Mapping[str, Any], owner: Mapping[str, Any]) -> bool:
    uid = owner["metadata"]["uid"]
    return any(
        ref.get("uid") == uid and ref.get("controller")
        for ref in obj["metadata"].get("ownerReferences") or []
    )


def template_hash(template: Mapping[str, Any]) -> str:
    text = json.dumps(template, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def resolve_count(value: int | str, total: int, round_up: bool) -> int:
    """An int-or-percent (maxSurge: rounded up, maxUnavailable: rounded down) of `total`."""
    if isinstance(value, int):
        return value
    if value.endswith("%"):
        share = total * int(value[:-1]) / 100
        return math.ceil(share) if round_up else math.floor(share)
    return int(value)


@dataclass(frozen=True)
class ReplicaSetView:
    name: str
    replicas: int  # spec.replicas
    pods: int  # pods not terminating
    available: int


def rolling_update(
    desired: int,
    max_surge: int,
    max_unavailable: int,
    new: ReplicaSetView,
    old: Sequence[ReplicaSetView],
) -> dict[str, int]:
    """The replica counts RollingUpdate sets now, by ReplicaSet name (oldest old first)."""
    if max_surge == 0 and max_unavailable == 0:
        max_unavailable = 1  # as the API server's defaulting would insist
    targets = {rs.name: rs.replicas for rs in [new, *old]}
    if new.replicas > desired:
        targets[new.name] = desired
    elif new.replicas < desired:
        all_replicas = sum(targets.values())
        room = desired + max_surge - all_replicas
        if room > 0:
            targets[new.name] = new.replicas + min(room, desired - new.replicas)

    old_replicas = sum(rs.replicas for rs in old)
    if old_replicas == 0:
        return targets
    min_available = desired - max_unavailable
    new_unavailable = targets[new.name] - new.available
    max_scaled_down = sum(targets.values()) - min_available - new_unavailable
    if max_scaled_down <= 0:
        return targets
    # First the old pods that are not available: removing them costs no availability.
    for rs in old:
        unhealthy = min(rs.replicas - rs.available, max_scaled_down)
        if unhealthy > 0:
            targets[rs.name] -= unhealthy
            max_scaled_down -= unhealthy
    available = new.available + sum(rs.available for rs in old)
    removable = min(available - min_available, max_scaled_down)
    for rs in old:
        if removable <= 0:
            break
        step = min(targets[rs.name], removable, rs.available)
        targets[rs.name] -= step
        removable -= step
    return targets


def recreate(
    desired: int, new: ReplicaSetView, old: Sequence[ReplicaSetView], old_pods_left: int
) -> dict[str, int]:
    """Recreate: old ReplicaSets to zero; the new one grows once every old pod is gone."""
    targets = {rs.name: 0 for rs in old}
    targets[new.name] = desired if old_pods_left == 0 else new.replicas
    return targets


def _condition(
    previous: Sequence[Mapping[str, Any]],
    kind: str,
    status: bool,
    reason: str,
    message: str,
    now: str,
) -> dict[str, Any]:
    before = next((c for c in previous if c.get("type") == kind), None)
    text = "True" if status else "False"
    unchanged = before is not None and before.get("status") == text
    same_reason = unchanged and before.get("reason") == reason
    return {
        "type": kind,
        "status": text,
        "reason": reason,
        "message": message,
        "lastTransitionTime": before["lastTransitionTime"] if unchanged else now,
        "lastUpdateTime": before.get("lastUpdateTime", now) if same_reason else now,
    }


def deployment_status(
    deployment: Mapping[str, Any],
    new_name: str,
    pods_by_rs: Mapping[str, Sequence[Mapping[str, Any]]],
    max_unavailable: int,
    now: str,
) -> dict[str, Any]:
    desired = deployment["spec"].get("replicas", 1)
    active = {name: [p for p in pods if not is_terminating(p)] for name, pods in pods_by_rs.items()}
    replicas = sum(len(pods) for pods in active.values())
    updated = len(active.get(new_name, []))
    ready = sum(1 for pods in active.values() for pod in pods if is_pod_ready(pod))
    complete = updated == desired and replicas == desired and ready == desired
    previous = (deployment.get("status") or {}).get("conditions") or []
    minimum = ready >= desired - max_unavailable
    conditions = [
        _condition(
            previous,
            "Available",
            minimum,
            "MinimumReplicasAvailable" if minimum else "MinimumReplicasUnavailable",
            "Deployment has minimum availability."
            if minimum
            else "Deployment does not have minimum availability.",
            now,
        ),
        _condition(
            previous,
            "Progressing",
            True,
            "NewReplicaSetAvailable" if complete else "ReplicaSetUpdated",
            f'ReplicaSet "{new_name}" has successfully progressed.'
            if complete
            else f'ReplicaSet "{new_name}" is progressing.',
            now,
        ),
    ]
    status = {
        "observedGeneration": deployment["metadata"].get("generation", 1),
        "replicas": replicas,
        "updatedReplicas": updated,
        "readyReplicas": ready,
        "availableReplicas": ready,
        "unavailableReplicas": max(desired - ready, 0),
        "conditions": conditions,
    }
    return status


def _without_times(status: Mapping[str, Any] | None) -> dict[str, Any]:
    status = dict(status or {})
    status["conditions"] = [
        {k: v for k, v in c.items() if not k.startswith("last")}
        for c in status.get("conditions") or []
    ]
    return status


def pods_to_delete(pods: Sequence[Mapping[str, Any]], count: int) -> list[Mapping[str, Any]]:
    """Like the ReplicaSet controller: pods not ready first, then the youngest."""
    if count <= 0:
        return []
    not_ready = [p for p in pods if not is_pod_ready(p)]
    ready = sorted(
        (p for p in pods if is_pod_ready(p)),
        key=lambda p: (p["metadata"]["creationTimestamp"], p["metadata"]["name"]),
        reverse=True,
    )
    return [*not_ready, *ready][:count]


class DeploymentStandin:
    def __init__(self, kube: KubeClient, namespace: str):
        self.kube = kube
        self.namespace = namespace

    async def sync(self, now: str) -> None:
        deployments = await self.kube.list("apps/v1", "Deployment", self.namespace)
        replica_sets = await self.kube.list("apps/v1", "ReplicaSet", self.namespace)
        pods = await self.kube.list("v1", "Pod", self.namespace)
        for deployment in deployments:
            if is_terminating(deployment):
                continue
            owned = [rs for rs in replica_sets if owned_by(rs, deployment)]
            await self._sync_deployment(deployment, owned, pods, now)
        replica_sets = await self.kube.list("apps/v1", "ReplicaSet", self.namespace)
        for rs in replica_sets:
            if not is_terminating(rs):
                await self._sync_replica_set(rs, [p for p in pods if owned_by(p, rs)])

    async def _sync_deployment(
        self,
        deployment: dict[str, Any],
        owned: list[dict[str, Any]],
        pods: list[dict[str, Any]],
        now: str,
    ) -> None:
        spec = deployment["spec"]
        desired = spec.get("replicas", 1)
        digest = template_hash(spec["template"])
        new = next(
            (
                rs
                for rs in owned
                if rs["metadata"].get("labels", {}).get(POD_TEMPLATE_HASH) == digest
            ),
            None,
        )
        if new is None:
            new = await self._create_replica_set(deployment, digest, owned)
            owned = [*owned, new]
        old = sorted(
            (rs for rs in owned if rs is not new),
            key=lambda rs: int(rs["metadata"].get("annotations", {}).get(REVISION_ANNOTATION, "0")),
        )
        pods_by_rs = {rs["metadata"]["name"]: [p for p in pods if owned_by(p, rs)] for rs in owned}

        def view(rs: dict[str, Any]) -> ReplicaSetView:
            mine = [p for p in pods_by_rs[rs["metadata"]["name"]] if not is_terminating(p)]
            return ReplicaSetView(
                rs["metadata"]["name"],
                rs["spec"].get("replicas", 0),
                len(mine),
                sum(1 for p in mine if is_pod_ready(p)),
            )

        strategy = spec.get("strategy") or {}
        max_unavailable = 0
        if strategy.get("type") == "Recreate":
            old_pods = sum(len(pods_by_rs[rs["metadata"]["name"]]) for rs in old)
            targets = recreate(desired, view(new), [view(rs) for rs in old], old_pods)
        else:
            rolling = strategy.get("rollingUpdate") or {}
            max_surge = resolve_count(rolling.get("maxSurge", "25%"), desired, round_up=True)
            max_unavailable = resolve_count(
                rolling.get("maxUnavailable", "25%"), desired, round_up=False
            )
            targets = rolling_update(
                desired, max_surge, max_unavailable, view(new), [view(rs) for rs in old]
            )
        for rs in owned:
            name = rs["metadata"]["name"]
            if targets.get(name, 0) != rs["spec"].get("replicas", 0):
                rs["spec"]["replicas"] = targets[name]
                await self.kube.merge_patch(
                    "apps/v1",
                    "ReplicaSet",
                    name,
                    self.namespace,
                    {"spec": {"replicas": targets[name]}},
                    missing_ok=True,
                )
        status = deployment_status(
            deployment, new["metadata"]["name"], pods_by_rs, max_unavailable, now
        )
        if _without_times(status) != _without_times(deployment.get("status")):
            await self.kube.merge_patch(
                "apps/v1",
                "Deployment",
                deployment["metadata"]["name"],
                self.namespace,
                {"status": status},
                subresource="status",
                missing_ok=True,
            )

    async def _create_replica_set(
        self, deployment: dict[str, Any], digest: str, owned: list[dict[str, Any]]
    ) -> dict[str, Any]:
        metadata = deployment["metadata"]
        template = json.loads(json.dumps(deployment["spec"]["template"]))
        labels = {**template["metadata"].get("labels", {}), POD_TEMPLATE_HASH: digest}
        template["metadata"]["labels"] = labels
        revision = 1 + max(
            (
                int(rs["metadata"].get("annotations", {}).get(REVISION_ANNOTATION, "0"))
                for rs in owned
            ),
            default=0,
        )
        selector = json.loads(json.dumps(deployment["spec"]["selector"]))
        selector.setdefault("matchLabels", {})[POD_TEMPLATE_HASH] = digest
        body = {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "metadata": {
                "name": f"{metadata['name']}-{digest}",
                "namespace": self.namespace,
                "labels": labels,
                "annotations": {REVISION_ANNOTATION: str(revision)},
                "ownerReferences": [
                    {
                        "apiVersion": "apps/v1",
                        "kind": "Deployment",
                        "name": metadata["name"],
                        "uid": metadata["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": {"replicas": 0, "selector": selector, "template": template},
        }
        return await self.kube.create(body)

    async def _sync_replica_set(self, rs: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        active = [p for p in pods if not is_terminating(p)]
        wanted = rs["spec"].get("replicas", 0)
        for _ in range(wanted - len(active)):
            await self._create_pod(rs)
        for pod in pods_to_delete(active, len(active) - wanted):
            await self.kube.delete("v1", "Pod", pod["metadata"]["name"], self.namespace)
        ready = sum(1 for p in active if is_pod_ready(p))
        status = {
            "replicas": len(active),
            "fullyLabeledReplicas": len(active),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "observedGeneration": rs["metadata"].get("generation", 1),
        }
        if status != {k: (rs.get("status") or {}).get(k, 0) for k in status}:
            await self.kube.merge_patch(
                "apps/v1",
                "ReplicaSet",
                rs["metadata"]["name"],
                self.namespace,
                {"status": status},
                subresource="status",
                missing_ok=True,
            )

    async def _create_pod(self, rs: dict[str, Any]) -> None:
        template = rs["spec"]["template"]
        metadata = rs["metadata"]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{metadata['name']}-{uuid.uuid4().hex[:5]}",
                "namespace": self.namespace,
                "labels": dict(template["metadata"].get("labels", {})),
                "annotations": dict(template["metadata"].get("annotations", {})),
                "finalizers": [KUBELET_FINALIZER],
                "ownerReferences": [
                    {
                        "apiVersion": "apps/v1",
                        "kind": "ReplicaSet",
                        "name": metadata["name"],
                        "uid": metadata["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": dict(template["spec"]),
        }
        await self.kube.create(pod)
