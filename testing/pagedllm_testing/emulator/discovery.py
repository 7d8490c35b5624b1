"""Discovery: /version, /api, /apis and the resource list of each group version."""

from __future__ import annotations

from typing import Any

from pagedllm_testing.emulator.errors import no_such_resource
from pagedllm_testing.emulator.resources import (
    BINDING_SUBRESOURCE,
    EVICTION_SUBRESOURCE,
    SCALE_SUBRESOURCE,
    ResourceType,
)
from pagedllm_testing.emulator.store import KubeEmulator

KUBERNETES_VERSION = {"major": "1", "minor": "32", "gitVersion": "v1.32.0-emulator"}
CORE_VERSIONS = {
    "kind": "APIVersions",
    "versions": ["v1"],
    "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}],
}
VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


def document(em: KubeEmulator, path: str) -> dict[str, Any] | None:
    """The discovery document at `path`, or None when `path` is not a discovery path."""
    if path == "/version":
        return KUBERNETES_VERSION
    if path == "/api":
        return CORE_VERSIONS
    groups = em.groups()
    if path == "/apis":
        return {
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [group_info(g, v) for g, v in sorted(groups.items()) if g],
        }
    if path == "/api/v1":
        return resource_list(em, "", "v1")
    parts = [p for p in path.split("/") if p]
    if parts[:1] != ["apis"] or len(parts) not in (2, 3):
        return None
    group = parts[1]
    if len(parts) == 2:
        if group not in groups:
            raise no_such_resource()
        return {"kind": "APIGroup", "apiVersion": "v1", **group_info(group, groups[group])}
    if parts[2] not in groups.get(group, []):
        raise no_such_resource()
    return resource_list(em, group, parts[2])


def group_info(group: str, versions: list[str]) -> dict[str, Any]:
    return {
        "name": group,
        "versions": [{"groupVersion": f"{group}/{v}", "version": v} for v in versions],
        "preferredVersion": {"groupVersion": f"{group}/{versions[0]}", "version": versions[0]},
    }


def resource_list(em: KubeEmulator, group: str, version: str) -> dict[str, Any]:
    resources = []
    for rtype in em.types_in(group, version):
        resources.append(_resource(rtype))
        resources += [_subresource(rtype, sub) for sub in sorted(rtype.subresources)]
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}" if group else version,
        "resources": resources,
    }


def _resource(rtype: ResourceType) -> dict[str, Any]:
    return {
        "name": rtype.plural,
        "singularName": rtype.singular,
        "namespaced": rtype.namespaced,
        "kind": rtype.kind,
        "verbs": VERBS,
        "shortNames": list(rtype.short_names),
        "categories": list(rtype.categories),
    }


def _subresource(rtype: ResourceType, sub: str) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": f"{rtype.plural}/{sub}",
        "singularName": "",
        "namespaced": rtype.namespaced,
        "kind": rtype.kind,
        "verbs": ["get", "patch", "update"],
    }
    if sub == SCALE_SUBRESOURCE:
        entry.update(group="autoscaling", version="v1", kind="Scale")
    elif sub == EVICTION_SUBRESOURCE:
        entry.update(group="policy", version="v1", kind="Eviction", verbs=["create"])
    elif sub == BINDING_SUBRESOURCE:
        entry.update(kind="Binding", verbs=["create"])
    return entry
