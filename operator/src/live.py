"""What is live in a namespace, read two ways: one call per object (a reconcile about to
write reads fresh), or one list per kind for a whole resync (a snapshot that answers every
PagedLLM of the namespace from memory)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from pagedllm.operator.children import LABEL_INSTANCE, LABEL_MANAGED_BY, OPERATOR_NAME
from pagedllm.operator.kube import KubeClient

# Every kind a PagedLLM's children come in (see children.build_children).
CHILD_KINDS: tuple[tuple[str, str], ...] = (
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
    ("v1", "ConfigMap"),
    ("policy/v1", "PodDisruptionBudget"),
    ("autoscaling/v2", "HorizontalPodAutoscaler"),
    ("v1", "ServiceAccount"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
)
SERVICE_MONITOR_KIND = ("monitoring.coreos.com/v1", "ServiceMonitor")
MANAGED_SELECTOR = f"{LABEL_MANAGED_BY}={OPERATOR_NAME}"
# Serving and router pods both carry the instance label (their Deployments' selectors).
PODS_SELECTOR = LABEL_INSTANCE


def label_selector(labels: Mapping[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


def _selects(labels: Mapping[str, str], pod: Mapping[str, Any]) -> bool:
    pod_labels = pod.get("metadata", {}).get("labels") or {}
    return all(pod_labels.get(key) == value for key, value in labels.items())


class Live(Protocol):
    """Reads of one namespace, as reconcile needs them."""

    async def get(self, api_version: str, kind: str, name: str) -> dict[str, Any] | None: ...

    async def pods(self, labels: Mapping[str, str]) -> list[dict[str, Any]]: ...


@dataclass(frozen=True)
class FreshReads:
    """Each read a call to the API server, answered as of now."""

    kube: KubeClient
    namespace: str

    async def get(self, api_version: str, kind: str, name: str) -> dict[str, Any] | None:
        return await self.kube.get(api_version, kind, name, self.namespace)

    async def pods(self, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        return await self.kube.list("v1", "Pod", self.namespace, label_selector(labels))


@dataclass(frozen=True)
class Snapshot:
    """The operator's children and the PagedLLMs' pods in a namespace, listed once.

    Only what carries the operator's label is in it: a child missing here may still exist
    unlabelled (someone else's object of the same name), which a fresh read finds out."""

    objects: Mapping[tuple[str, str], dict[str, Any]]  # (kind, name) -> object
    all_pods: tuple[dict[str, Any], ...]

    async def get(self, api_version: str, kind: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((kind, name))

    async def pods(self, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        return [pod for pod in self.all_pods if _selects(labels, pod)]


def snapshot_of(
    listed: Iterable[tuple[str, list[dict[str, Any]]]], pods: list[dict[str, Any]]
) -> Snapshot:
    objects = {(kind, item["metadata"]["name"]): item for kind, items in listed for item in items}
    return Snapshot(objects=objects, all_pods=tuple(pods))


async def read_snapshot(kube: KubeClient, namespace: str, service_monitors: bool) -> Snapshot:
    kinds = CHILD_KINDS + ((SERVICE_MONITOR_KIND,) if service_monitors else ())
    *lists, pods = await asyncio.gather(
        *(kube.list(api_version, kind, namespace, MANAGED_SELECTOR) for api_version, kind in kinds),
        kube.list("v1", "Pod", namespace, PODS_SELECTOR),
    )
    return snapshot_of(zip((kind for _, kind in kinds), lists, strict=True), pods)
