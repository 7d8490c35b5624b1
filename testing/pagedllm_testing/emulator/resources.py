"""The resource types the emulator serves: the built-in kinds and those a CRD defines."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

STATUS_SUBRESOURCE = "status"
SCALE_SUBRESOURCE = "scale"
# The pods' POST-only subresources (testing/pagedllm_testing/emulator/pod_actions.py).
BINDING_SUBRESOURCE = "binding"
EVICTION_SUBRESOURCE = "eviction"


@dataclass(frozen=True)
class ScalePaths:
    spec_replicas: str = ".spec.replicas"
    status_replicas: str = ".status.replicas"
    label_selector: str | None = None  # None: built from .spec.selector (apps/v1 style)


@dataclass(frozen=True)
class PrinterColumn:
    name: str
    json_path: str
    type: str = "string"
    priority: int = 0


@dataclass(frozen=True)
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    subresources: frozenset[str] = frozenset({STATUS_SUBRESOURCE})
    scale: ScalePaths | None = None
    printer_columns: tuple[PrinterColumn, ...] = ()
    schema: dict[str, Any] | None = field(default=None, compare=False, hash=False)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_version_path(self) -> str:
        return f"/apis/{self.group}/{self.version}" if self.group else "/api/v1"

    @property
    def singular(self) -> str:
        return self.kind.lower()

    @property
    def qualified(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def has_status(self) -> bool:
        return STATUS_SUBRESOURCE in self.subresources


def _workload(plural: str, kind: str, short_name: str) -> ResourceType:
    """An apps/v1 kind with a pod template, scalable through /scale."""
    return ResourceType(
        "apps",
        "v1",
        plural,
        kind,
        short_names=(short_name,),
        categories=("all",),
        subresources=frozenset({STATUS_SUBRESOURCE, SCALE_SUBRESOURCE}),
        scale=ScalePaths(),
    )


BUILTIN_TYPES: tuple[ResourceType, ...] = (
    ResourceType("", "v1", "namespaces", "Namespace", namespaced=False, short_names=("ns",)),
    ResourceType("", "v1", "nodes", "Node", namespaced=False, short_names=("no",)),
    ResourceType(
        "",
        "v1",
        "pods",
        "Pod",
        short_names=("po",),
        categories=("all",),
        subresources=frozenset({STATUS_SUBRESOURCE, BINDING_SUBRESOURCE, EVICTION_SUBRESOURCE}),
    ),
    ResourceType("", "v1", "services", "Service", short_names=("svc",), categories=("all",)),
    ResourceType("", "v1", "endpoints", "Endpoints", short_names=("ep",), subresources=frozenset()),
    ResourceType("", "v1", "secrets", "Secret", subresources=frozenset()),
    ResourceType(
        "", "v1", "configmaps", "ConfigMap", short_names=("cm",), subresources=frozenset()
    ),
    ResourceType(
        "", "v1", "serviceaccounts", "ServiceAccount", short_names=("sa",), subresources=frozenset()
    ),
    ResourceType("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", short_names=("pvc",)),
    ResourceType("", "v1", "events", "Event", short_names=("ev",), subresources=frozenset()),
    _workload("deployments", "Deployment", "deploy"),
    _workload("replicasets", "ReplicaSet", "rs"),
    _workload("statefulsets", "StatefulSet", "sts"),
    ResourceType(
        "policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", short_names=("pdb",)
    ),
    ResourceType(
        "autoscaling",
        "v2",
        "horizontalpodautoscalers",
        "HorizontalPodAutoscaler",
        short_names=("hpa",),
        categories=("all",),
    ),
    ResourceType(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        namespaced=False,
        short_names=("crd", "crds"),
    ),
    ResourceType(
        "rbac.authorization.k8s.io",
        "v1",
        "clusterroles",
        "ClusterRole",
        namespaced=False,
        subresources=frozenset(),
    ),
    ResourceType(
        "rbac.authorization.k8s.io",
        "v1",
        "clusterrolebindings",
        "ClusterRoleBinding",
        namespaced=False,
        subresources=frozenset(),
    ),
    ResourceType("rbac.authorization.k8s.io", "v1", "roles", "Role", subresources=frozenset()),
    ResourceType(
        "rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding", subresources=frozenset()
    ),
    ResourceType(
        "discovery.k8s.io", "v1", "endpointslices", "EndpointSlice", subresources=frozenset()
    ),
    ResourceType("coordination.k8s.io", "v1", "leases", "Lease", subresources=frozenset()),
    ResourceType(
        "events.k8s.io", "v1", "events", "Event", short_names=("ev",), subresources=frozenset()
    ),
)

# The namespaces every cluster starts with.
INITIAL_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")


def resource_types_from_crd(crd: dict[str, Any]) -> list[ResourceType]:
    spec = crd["spec"]
    names = spec["names"]
    types = []
    for version in spec["versions"]:
        if not version.get("served", True):
            continue
        subresources = version.get("subresources") or {}
        scale = subresources.get("scale")
        columns = tuple(
            PrinterColumn(
                name=column["name"],
                json_path=column["jsonPath"],
                type=column.get("type", "string"),
                priority=column.get("priority", 0),
            )
            for column in version.get("additionalPrinterColumns", [])
        )
        types.append(
            ResourceType(
                group=spec["group"],
                version=version["name"],
                plural=names["plural"],
                kind=names["kind"],
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                short_names=tuple(names.get("shortNames", [])),
                categories=tuple(names.get("categories", [])),
                subresources=frozenset(subresources),
                scale=ScalePaths(
                    spec_replicas=scale["specReplicasPath"],
                    status_replicas=scale["statusReplicasPath"],
                    label_selector=scale.get("labelSelectorPath"),
                )
                if scale is not None
                else None,
                printer_columns=columns,
                schema=(version.get("schema") or {}).get("openAPIV3Schema"),
            )
        )
    return types


def version_priority(version: str) -> tuple[int, int, int]:
    """Kubernetes' version order: GA before beta before alpha, higher numbers first."""
    match = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", version)
    if not match:
        return (3, 0, 0)
    major, stage, minor = match.groups()
    return ({None: 0, "beta": 1, "alpha": 2}[stage], -int(major), -int(minor or 0))
