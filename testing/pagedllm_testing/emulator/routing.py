"""What a resource request names: the kind, namespace, object and subresource of its path."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm_testing.emulator.errors import no_such_resource
from pagedllm_testing.emulator.resources import ResourceType
from pagedllm_testing.emulator.store import KubeEmulator


@dataclass(frozen=True)
class ResourceRequest:
    rtype: ResourceType
    namespace: str | None
    name: str | None
    subresource: str | None


def parse_resource_path(emulator: KubeEmulator, path: str) -> ResourceRequest | None:
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"] and len(parts) >= 3:
        group, version, rest = "", parts[1], parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 4:
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    namespace = None
    namespace_object = rest[0] == "namespaces" and (
        len(rest) <= 2 or (len(rest) == 3 and rest[2] in ("status", "finalize"))
    )
    if rest[0] == "namespaces" and not namespace_object:
        namespace, rest = rest[1], rest[2:]
    rtype = emulator.find_type(group, version, rest[0])
    name = rest[1] if len(rest) > 1 else None
    subresource = "/".join(rest[2:]) or None
    if subresource and subresource not in rtype.subresources and subresource != "finalize":
        raise no_such_resource()
    return ResourceRequest(rtype, namespace, name, subresource)
