"""A Kubernetes API server emulator on loopback, good enough for kopf and the real kubectl.

It keeps objects in memory and speaks the REST API: discovery (/api, /apis, /openapi/v3),
list and watch (replay from a resourceVersion, bookmarks, the initial-events bookmark),
get, create, replace, the four patch types (JSON, merge, strategic, server-side apply),
delete with finalizers and owner-reference garbage collection, the status and scale
subresources, label and field selectors, server-side Tables for `kubectl get`, and custom
resources from the CRDs created in it (defaults, pruning, schema and CEL validation).

No controllers run here: nothing turns a Deployment into pods. Run it standalone with

    python -m e2e.kube_emulator --port 8001 --kubeconfig /tmp/kubeconfig

or in-process from tests with `EmulatorThread`.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import datetime
import json
import re
import signal
import sys
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from e2e import crd_validation

KUBERNETES_VERSION = {"major": "1", "minor": "32", "gitVersion": "v1.32.0-emulator"}
TABLE_GROUP_VERSION = "meta.k8s.io/v1"
EVENT_LOG_LIMIT = 20_000
NAMESPACE_CLEANUP_DELAY = 1.0  # seconds a deleted namespace stays Terminating
GARBAGE_COLLECTION_DELAY = 0.2  # seconds before a dependent of a deleted owner goes
STATUS_SUBRESOURCE = "status"
SCALE_SUBRESOURCE = "scale"


# ---------------------------------------------------------------------------------------------
# Resource types


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


_APPS_SCALE = ScalePaths()


BUILTIN_TYPES: tuple[ResourceType, ...] = (
    ResourceType("", "v1", "namespaces", "Namespace", namespaced=False, short_names=("ns",)),
    ResourceType("", "v1", "nodes", "Node", namespaced=False, short_names=("no",)),
    ResourceType("", "v1", "pods", "Pod", short_names=("po",), categories=("all",)),
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
    ResourceType(
        "apps",
        "v1",
        "deployments",
        "Deployment",
        short_names=("deploy",),
        categories=("all",),
        subresources=frozenset({"status", "scale"}),
        scale=_APPS_SCALE,
    ),
    ResourceType(
        "apps",
        "v1",
        "replicasets",
        "ReplicaSet",
        short_names=("rs",),
        categories=("all",),
        subresources=frozenset({"status", "scale"}),
        scale=_APPS_SCALE,
    ),
    ResourceType(
        "apps",
        "v1",
        "statefulsets",
        "StatefulSet",
        short_names=("sts",),
        categories=("all",),
        subresources=frozenset({"status", "scale"}),
        scale=_APPS_SCALE,
    ),
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


# ---------------------------------------------------------------------------------------------
# Errors


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: dict | None = None):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details or {}

    def as_status(self) -> dict[str, Any]:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "details": self.details,
            "code": self.code,
        }


def _details(rtype: ResourceType, name: str | None) -> dict[str, Any]:
    return {"name": name or "", "group": rtype.group, "kind": rtype.plural}


def not_found(rtype: ResourceType, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{rtype.qualified} "{name}" not found', _details(rtype, name))


def already_exists(rtype: ResourceType, name: str) -> ApiError:
    return ApiError(
        409, "AlreadyExists", f'{rtype.qualified} "{name}" already exists', _details(rtype, name)
    )


def conflict(rtype: ResourceType, name: str) -> ApiError:
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {rtype.qualified} "{name}": the object has been '
        "modified; please apply your changes to the latest version and try again",
        _details(rtype, name),
    )


def invalid(rtype: ResourceType, name: str, causes: list[tuple[str, str]]) -> ApiError:
    text = ", ".join(f"{path}: {message}" for path, message in causes)
    details = _details(rtype, name)
    details["kind"] = rtype.kind
    details["causes"] = [
        {"reason": "FieldValueInvalid", "message": message, "field": path}
        for path, message in causes
    ]
    return ApiError(
        422, "Invalid", f'{rtype.kind}.{rtype.group or "core"} "{name}" is invalid: {text}', details
    )


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


# ---------------------------------------------------------------------------------------------
# Pure helpers: time, paths, patches, selectors


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _age(timestamp: str | None) -> str:
    if not timestamp:
        return "<unknown>"
    created = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(
        tzinfo=datetime.timezone.utc
    )
    seconds = int((datetime.datetime.now(datetime.timezone.utc) - created).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def get_path(obj: Any, dotted: str) -> Any:
    """A tiny JSONPath subset: `.a.b`, `.a[0]`, `.a[?(@.k=="v")].b`."""
    current = [obj]
    for token in re.findall(r"\.([^.\[]+)|\[\?\(@\.(\w+)==\"([^\"]*)\"\)\]|\[(\d+)\]", dotted):
        key, filter_key, filter_value, index = token
        found = []
        for item in current:
            if key and isinstance(item, dict) and key in item:
                found.append(item[key])
            elif filter_key and isinstance(item, list):
                found += [
                    x
                    for x in item
                    if isinstance(x, dict) and str(x.get(filter_key)) == filter_value
                ]
            elif index and isinstance(item, list) and int(index) < len(item):
                found.append(item[int(index)])
        current = found
    return current[0] if current else None


def set_path(obj: dict[str, Any], dotted: str, value: Any) -> None:
    keys = [key for key in dotted.split(".") if key]
    for key in keys[:-1]:
        obj = obj.setdefault(key, {})
    obj[keys[-1]] = value


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# The list merge keys Kubernetes' strategic merge patch uses, most specific first.
_MERGE_KEYS = ("mountPath", "containerPort", "uid", "type", "name", "ip", "devicePath")


def _merge_key(items: list[Any]) -> str | None:
    dicts = [item for item in items if isinstance(item, dict)]
    if not dicts or len(dicts) != len(items):
        return None
    for key in _MERGE_KEYS:
        if all(key in item for item in dicts if item.get("$patch") != "replace"):
            return key
    return None


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Strategic merge patch without the Go type information: lists of objects merge on the
    first well-known key (name, containerPort, ...) all their items carry; other lists are
    replaced. Honours the $patch, $retainKeys, $deleteFromPrimitiveList and
    $setElementOrder directives kubectl sends."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: v for k, v in patch.items() if k != "$patch"}
    if patch.get("$patch") == "delete":
        return None
    result = dict(target) if isinstance(target, dict) else {}
    retain = patch.get("$retainKeys")
    for key, value in patch.items():
        if key.startswith("$setElementOrder/") or key in ("$retainKeys", "$patch"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            result[name] = [x for x in result.get(name, []) if x not in value]
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and isinstance(result.get(key), list):
            result[key] = _merge_lists(result[key], value)
        elif isinstance(value, list):
            result[key] = [
                {k: v for k, v in item.items() if not k.startswith("$")}
                if isinstance(item, dict)
                else item
                for item in value
                if not (isinstance(item, dict) and item.get("$patch"))
            ]
        else:
            result[key] = strategic_merge_patch(result.get(key), value)
    if retain is not None:
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _merge_lists(current: list[Any], patch: list[Any]) -> list[Any]:
    key = _merge_key(patch)
    if key is None or not all(isinstance(item, dict) for item in current):
        return copy.deepcopy(patch)
    merged = [copy.deepcopy(item) for item in current]
    for item in patch:
        if item.get("$patch") == "replace":
            return [{k: v for k, v in x.items() if k != "$patch"} for x in patch]
        position = next((i for i, x in enumerate(merged) if x.get(key) == item.get(key)), None)
        if item.get("$patch") == "delete":
            if position is not None:
                merged.pop(position)
        elif position is None:
            merged.append(strategic_merge_patch({}, item))
        else:
            merged[position] = strategic_merge_patch(merged[position], item)
    return merged


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    return [part.replace("~1", "/").replace("~0", "~") for part in path.lstrip("/").split("/")]


def _resolve(doc: Any, parts: list[str]) -> Any:
    for part in parts:
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


class JsonPatchTestFailed(Exception):
    pass


def json_patch(doc: Any, operations: list[dict[str, Any]]) -> Any:  # noqa: C901 (to split)
    """RFC 6902. Raises JsonPatchTestFailed for a failed `test`, KeyError/IndexError for a bad
    path."""
    doc = copy.deepcopy(doc)
    for operation in operations:
        op = operation["op"]
        parts = _pointer(operation["path"])
        if op == "test":
            try:
                actual = _resolve(doc, parts)
            except (KeyError, IndexError) as error:
                raise JsonPatchTestFailed(operation["path"]) from error
            if actual != operation.get("value"):
                raise JsonPatchTestFailed(operation["path"])
            continue
        if op in ("move", "copy"):
            source = _pointer(operation["from"])
            value = copy.deepcopy(_resolve(doc, source))
            if op == "move":
                parent = _resolve(doc, source[:-1])
                del parent[int(source[-1]) if isinstance(parent, list) else source[-1]]
            op, operation = "add", {"value": value}
        if not parts:
            doc = copy.deepcopy(operation.get("value"))
            continue
        parent = _resolve(doc, parts[:-1])
        last = parts[-1]
        if isinstance(parent, list):
            index = len(parent) if last == "-" else int(last)
            if op == "add":
                parent.insert(index, copy.deepcopy(operation["value"]))
            elif op == "remove":
                parent.pop(index)
            elif op == "replace":
                parent[index] = copy.deepcopy(operation["value"])
        else:
            if op in ("remove", "replace") and last not in parent:
                raise KeyError(operation["path"])
            if op == "remove":
                del parent[last]
            else:
                parent[last] = copy.deepcopy(operation["value"])
    return doc


def _leaf_paths(value: Any, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """The fields a server-side apply intent owns: scalars and lists are atomic leaves."""
    if isinstance(value, dict) and value:
        paths: set[tuple[str, ...]] = set()
        for key, item in value.items():
            paths |= _leaf_paths(item, prefix + (key,))
        return paths
    return {prefix}


def _has_path(obj: Any, path: tuple[str, ...]) -> bool:
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return False
        obj = obj[key]
    return True


def _remove_path(obj: dict[str, Any], path: tuple[str, ...], keep: dict[str, Any]) -> None:
    """Remove a field, then the maps it leaves empty unless `keep` (the new intent) has them."""
    parents = [obj]
    for key in path[:-1]:
        child = parents[-1].get(key)
        if not isinstance(child, dict):
            return
        parents.append(child)
    parents[-1].pop(path[-1], None)
    for depth in range(len(path) - 1, 0, -1):
        if parents[depth] or _has_path(keep, path[:depth]):
            return
        parents[depth - 1].pop(path[depth - 1], None)


def _deep_merge(base: Any, overlay: Any) -> Any:
    if isinstance(base, dict) and isinstance(overlay, dict):
        result = dict(base)
        for key, value in overlay.items():
            result[key] = _deep_merge(base.get(key), value)
        return result
    return copy.deepcopy(overlay)


def server_side_apply(
    live: dict[str, Any], previous_intent: dict[str, Any] | None, intent: dict[str, Any]
) -> dict[str, Any]:
    """Apply an intent for one field manager: fields it applied before and dropped now are
    removed, the rest is merged in (lists atomically)."""
    result = copy.deepcopy(live)
    if previous_intent is not None:
        for path in _leaf_paths(previous_intent) - _leaf_paths(intent):
            if path[:1] != ("metadata",) or path[:2] in (
                ("metadata", "labels"),
                ("metadata", "annotations"),
            ):
                _remove_path(result, path, intent)
    return _deep_merge(result, intent)


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: str  # =, !=, in, notin, exists, !exists
    values: tuple[str, ...] = ()

    def matches(self, labels: dict[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.operator == "exists":
            return present
        if self.operator == "!exists":
            return not present
        if self.operator in ("=", "in"):
            return present and value in self.values
        return not present or value not in self.values  # != and notin


def parse_label_selector(text: str) -> list[Requirement]:
    requirements = []
    for part in re.findall(r"[^,(]+(?:\([^)]*\))?", text or ""):
        part = part.strip()
        if not part:
            continue
        match = re.fullmatch(r"([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)", part)
        if match:
            values = tuple(v.strip() for v in match.group(3).split(",") if v.strip())
            requirements.append(Requirement(match.group(1), match.group(2), values))
        elif "!=" in part:
            key, value = part.split("!=", 1)
            requirements.append(Requirement(key.strip(), "!=", (value.strip(),)))
        elif "=" in part:
            key, value = part.replace("==", "=").split("=", 1)
            requirements.append(Requirement(key.strip(), "=", (value.strip(),)))
        elif part.startswith("!"):
            requirements.append(Requirement(part[1:].strip(), "!exists"))
        else:
            requirements.append(Requirement(part, "exists"))
    return requirements


def parse_field_selector(text: str) -> list[tuple[str, bool, str]]:
    selectors = []
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        if "!=" in part:
            path, value = part.split("!=", 1)
            selectors.append((path.strip(), False, value.strip()))
        else:
            path, value = part.replace("==", "=").split("=", 1)
            selectors.append((path.strip(), True, value.strip()))
    return selectors


def selector_string(selector: dict[str, Any] | None) -> str:
    """A LabelSelector object as the string form /scale reports."""
    if not selector:
        return ""
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expression in selector.get("matchExpressions") or []:
        operator = expression["operator"]
        if operator == "Exists":
            parts.append(expression["key"])
        elif operator == "DoesNotExist":
            parts.append(f"!{expression['key']}")
        else:
            values = ",".join(expression.get("values", []))
            parts.append(f"{expression['key']} {operator.lower()} ({values})")
    return ",".join(parts)


@dataclass(frozen=True)
class Selection:
    namespace: str | None
    labels: list[Requirement]
    fields: list[tuple[str, bool, str]]

    def matches(self, obj: dict[str, Any] | None) -> bool:
        if obj is None:
            return False
        metadata = obj.get("metadata", {})
        if self.namespace is not None and metadata.get("namespace") != self.namespace:
            return False
        labels = metadata.get("labels") or {}
        if not all(requirement.matches(labels) for requirement in self.labels):
            return False
        for path, equal, value in self.fields:
            actual = get_path(obj, "." + path)
            actual_text = "" if actual is None else str(actual)
            if (actual_text == value) != equal:
                return False
        return True


# ---------------------------------------------------------------------------------------------
# The store


ObjectKey = tuple[str, str, str, str]  # group, plural, namespace ("" if cluster-wide), name


@dataclass
class WatchEvent:
    resource_version: int
    rtype_key: tuple[str, str]
    type: str
    obj: dict[str, Any]
    old: dict[str, Any] | None


@dataclass
class Watcher:
    rtype_key: tuple[str, str]
    selection: Selection
    queue: asyncio.Queue[WatchEvent | None]  # None: the server is stopping


class KubeEmulator:
    """The state of the emulated cluster and the API operations on it (no HTTP here)."""

    def __init__(self) -> None:
        self.types: dict[tuple[str, str, str], ResourceType] = {}
        self.objects: dict[ObjectKey, dict[str, Any]] = {}
        self.applied_intents: dict[tuple[ObjectKey, str], dict[str, Any]] = {}
        self.revision = 0
        self.event_log: list[WatchEvent] = []
        self.watchers: list[Watcher] = []
        for rtype in BUILTIN_TYPES:
            self.register_type(rtype)
        namespaces = self.find_type("", "v1", "namespaces")
        for name in INITIAL_NAMESPACES:
            self.create(namespaces, None, {"metadata": {"name": name}})

    # --- types ---------------------------------------------------------------------------

    def register_type(self, rtype: ResourceType) -> None:
        self.types[(rtype.group, rtype.version, rtype.plural)] = rtype

    def find_type(self, group: str, version: str, plural: str) -> ResourceType:
        rtype = self.types.get((group, version, plural))
        if rtype is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        return rtype

    def groups(self) -> dict[str, list[str]]:
        """Group -> served versions, preferred first."""
        result: dict[str, list[str]] = {}
        for group, version, _ in self.types:
            versions = result.setdefault(group, [])
            if version not in versions:
                versions.append(version)
        for versions in result.values():
            versions.sort(key=_version_priority)
        return result

    # --- reading -------------------------------------------------------------------------

    @staticmethod
    def key(rtype: ResourceType, namespace: str | None, name: str) -> ObjectKey:
        return (rtype.group, rtype.plural, (namespace or "") if rtype.namespaced else "", name)

    def get(self, rtype: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        obj = self.objects.get(self.key(rtype, namespace, name))
        if obj is None:
            raise not_found(rtype, name)
        return self._view(rtype, obj)

    def list(self, rtype: ResourceType, selection: Selection) -> list[dict[str, Any]]:
        return [
            self._view(rtype, obj)
            for (group, plural, _, _), obj in sorted(self.objects.items())
            if (group, plural) == (rtype.group, rtype.plural) and selection.matches(obj)
        ]

    def _view(self, rtype: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
        view = copy.deepcopy(obj)
        view["apiVersion"] = rtype.api_version
        view["kind"] = rtype.kind
        return view

    # --- writing -------------------------------------------------------------------------

    def _next_revision(self) -> int:
        self.revision += 1
        return self.revision

    def _emit(
        self, rtype: ResourceType, event_type: str, obj: dict[str, Any], old: dict[str, Any] | None
    ) -> None:
        event = WatchEvent(
            int(obj["metadata"]["resourceVersion"]),
            (rtype.group, rtype.plural),
            event_type,
            copy.deepcopy(obj),
            old,
        )
        self.event_log.append(event)
        del self.event_log[:-EVENT_LOG_LIMIT]
        for watcher in self.watchers:
            if watcher.rtype_key == event.rtype_key:
                watcher.queue.put_nowait(event)

    def _require_namespace(self, rtype: ResourceType, namespace: str | None) -> None:
        if not rtype.namespaced:
            return
        if not namespace:
            raise bad_request("the namespace of the object is required")
        ns_key = ("", "namespaces", "", namespace)
        ns = self.objects.get(ns_key)
        if ns is None:
            raise ApiError(
                404,
                "NotFound",
                f'namespaces "{namespace}" not found',
                {"name": namespace, "kind": "namespaces"},
            )
        if ns["metadata"].get("deletionTimestamp"):
            raise ApiError(
                403,
                "Forbidden",
                f"unable to create new content in namespace "
                f"{namespace} because it is being terminated",
            )

    def create(
        self,
        rtype: ResourceType,
        namespace: str | None,
        body: dict[str, Any],
        *,
        strict_fields: bool = False,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        obj = copy.deepcopy(body)
        metadata = obj.setdefault("metadata", {})
        if rtype.namespaced:
            if metadata.get("namespace") and namespace and metadata["namespace"] != namespace:
                raise bad_request(
                    "the namespace of the provided object does not match the "
                    "namespace sent on the request"
                )
            namespace = namespace or metadata.get("namespace")
            metadata["namespace"] = namespace
        else:
            metadata.pop("namespace", None)
        if not metadata.get("name"):
            if metadata.get("generateName"):
                metadata["name"] = metadata["generateName"] + uuid.uuid4().hex[:5]
            else:
                raise invalid(
                    rtype,
                    "",
                    [("metadata.name", "Required value: name or generateName is required")],
                )
        self._require_namespace(rtype, namespace)
        key = self.key(rtype, namespace, metadata["name"])
        if key in self.objects:
            raise already_exists(rtype, metadata["name"])
        obj = self._admit(rtype, obj, None, strict_fields)
        metadata = obj["metadata"]
        for server_owned in (
            "resourceVersion",
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "generation",
            "managedFields",
            "selfLink",
        ):
            metadata.pop(server_owned, None)
        if rtype.has_status:
            obj.pop("status", None)  # written through /status only, as on a real server
        metadata["uid"] = str(uuid.uuid4())
        metadata["creationTimestamp"] = now_rfc3339()
        metadata["generation"] = 1
        obj["apiVersion"], obj["kind"] = rtype.api_version, rtype.kind
        if dry_run:
            metadata["resourceVersion"] = str(self.revision)
            return self._view(rtype, obj)
        metadata["resourceVersion"] = str(self._next_revision())
        self.objects[key] = obj
        self._after_write(rtype, obj, None)
        self._emit(rtype, "ADDED", obj, None)
        if self._owners_all_gone(obj):
            # Created for an owner already deleted (a controller that read it just before):
            # the garbage collector removes such a dependent shortly after, as on a cluster.
            self._later(
                GARBAGE_COLLECTION_DELAY,
                lambda: self._collect_dangling(rtype, key, metadata["uid"]),
            )
        return self._view(rtype, obj)

    def _owners_all_gone(self, obj: dict[str, Any]) -> bool:
        owners = {ref.get("uid") for ref in obj["metadata"].get("ownerReferences") or []}
        return bool(owners) and not owners & {o["metadata"]["uid"] for o in self.objects.values()}

    def _collect_dangling(self, rtype: ResourceType, key: ObjectKey, uid: str) -> None:
        obj = self.objects.get(key)
        if obj is not None and obj["metadata"]["uid"] == uid and self._owners_all_gone(obj):
            self.delete(rtype, key[2] or None, key[3])

    @staticmethod
    def _later(delay: float, action: Callable[[], None]) -> None:
        try:
            asyncio.get_running_loop().call_later(delay, action)
        except RuntimeError:  # used without an event loop: at once
            action()

    def update(
        self,
        rtype: ResourceType,
        namespace: str | None,
        name: str,
        change: Callable[[dict[str, Any]], dict[str, Any]],
        *,
        subresource: str | None,
        strict_fields: bool = False,
        dry_run: bool = False,
        expected_version: str | None = None,
    ) -> dict[str, Any]:
        """Read-modify-write: `change` maps the current object to the wanted one."""
        key = self.key(rtype, namespace, name)
        current = self.objects.get(key)
        if current is None:
            raise not_found(rtype, name)
        wanted = change(self._view(rtype, current))
        wanted_version = (wanted.get("metadata") or {}).get("resourceVersion")
        expected = expected_version or wanted_version
        if expected and expected != current["metadata"]["resourceVersion"]:
            raise conflict(rtype, name)
        merged = self._restrict_to_subresource(rtype, current, wanted, subresource)
        merged = self._admit(rtype, merged, current, strict_fields)
        if _without_revision(merged) == _without_revision(current):
            return self._view(rtype, current)  # a no-op write changes nothing, not even the RV
        if _spec_changed(rtype, current, merged):
            merged["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
        if dry_run:
            return self._view(rtype, merged)
        merged["metadata"]["resourceVersion"] = str(self._next_revision())
        if merged["metadata"].get("deletionTimestamp") and not merged["metadata"].get("finalizers"):
            self._remove(rtype, key, merged)
            return self._view(rtype, merged)
        self.objects[key] = merged
        self._after_write(rtype, merged, current)
        self._emit(rtype, "MODIFIED", merged, current)
        return self._view(rtype, merged)

    def _restrict_to_subresource(
        self,
        rtype: ResourceType,
        current: dict[str, Any],
        wanted: dict[str, Any],
        subresource: str | None,
    ) -> dict[str, Any]:
        merged = copy.deepcopy(wanted)
        merged["metadata"] = {**wanted.get("metadata", {})}
        for immutable in (
            "uid",
            "creationTimestamp",
            "namespace",
            "name",
            "generation",
            "deletionTimestamp",
        ):
            if immutable in current["metadata"]:
                merged["metadata"][immutable] = current["metadata"][immutable]
            else:
                merged["metadata"].pop(immutable, None)
        merged["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        merged["apiVersion"], merged["kind"] = rtype.api_version, rtype.kind
        if subresource == STATUS_SUBRESOURCE:
            result = copy.deepcopy(current)
            if "status" in wanted:
                result["status"] = wanted["status"]
            else:
                result.pop("status", None)
            return result
        if rtype.has_status:
            if "status" in current:
                merged["status"] = copy.deepcopy(current["status"])
            else:
                merged.pop("status", None)
        return merged

    def _admit(
        self,
        rtype: ResourceType,
        obj: dict[str, Any],
        old: dict[str, Any] | None,
        strict_fields: bool,
    ) -> dict[str, Any]:
        """Defaulting, pruning and validation, for custom resources with a schema."""
        if rtype.schema is None:
            return obj
        name = obj.get("metadata", {}).get("name", "")
        unknown = crd_validation.unknown_fields(rtype.schema, obj)
        if unknown and strict_fields:
            raise ApiError(
                400,
                "BadRequest",
                f'strict decoding error: unknown field "{unknown[0].lstrip(".")}"',
            )
        metadata = obj.get("metadata", {})
        obj = crd_validation.prune(rtype.schema, {k: v for k, v in obj.items() if k != "metadata"})
        obj["metadata"] = metadata
        obj = crd_validation.apply_defaults(rtype.schema, obj)
        errors = crd_validation.validate(rtype.schema, obj, old)
        if errors:
            raise invalid(rtype, name, [(e.path.lstrip("."), e.message) for e in errors])
        return obj

    def _after_write(
        self, rtype: ResourceType, obj: dict[str, Any], old: dict[str, Any] | None
    ) -> None:
        """What controllers inside a real API server do at once: CRDs get established."""
        if rtype.plural == "customresourcedefinitions" and rtype.group == "apiextensions.k8s.io":
            if old is not None:
                for stale in resource_types_from_crd(old):
                    self.types.pop((stale.group, stale.version, stale.plural), None)
            for new in resource_types_from_crd(obj):
                self.register_type(new)
            names = obj["spec"]["names"]
            obj["status"] = {
                "acceptedNames": {k: v for k, v in names.items()},
                "storedVersions": [v["name"] for v in obj["spec"]["versions"] if v.get("storage")],
                "conditions": [
                    {
                        "type": "NamesAccepted",
                        "status": "True",
                        "reason": "NoConflicts",
                        "message": "no conflicts found",
                        "lastTransitionTime": now_rfc3339(),
                    },
                    {
                        "type": "Established",
                        "status": "True",
                        "reason": "InitialNamesAccepted",
                        "message": "the initial names have been accepted",
                        "lastTransitionTime": now_rfc3339(),
                    },
                ],
            }
        if rtype.plural == "namespaces" and not rtype.group:
            obj.setdefault("status", {})["phase"] = (
                "Terminating" if obj["metadata"].get("deletionTimestamp") else "Active"
            )

    def delete(
        self, rtype: ResourceType, namespace: str | None, name: str, *, dry_run: bool = False
    ) -> dict[str, Any]:
        key = self.key(rtype, namespace, name)
        current = self.objects.get(key)
        if current is None:
            raise not_found(rtype, name)
        if dry_run:
            return self._view(rtype, current)
        if current["metadata"].get("finalizers") or (
            rtype.plural == "namespaces" and not rtype.group
        ):
            if current["metadata"].get("deletionTimestamp"):
                return self._view(rtype, current)
            marked = copy.deepcopy(current)
            marked["metadata"]["deletionTimestamp"] = now_rfc3339()
            marked["metadata"]["resourceVersion"] = str(self._next_revision())
            self.objects[key] = marked
            self._after_write(rtype, marked, current)
            self._emit(rtype, "MODIFIED", marked, current)
            if rtype.plural == "namespaces" and not rtype.group:
                # Like the namespace controller: Terminating for a moment, then emptied.
                self._later(NAMESPACE_CLEANUP_DELAY, lambda: self._finish_namespace(name))
            return self._view(rtype, marked)
        self._remove(rtype, key, current)
        return self._view(rtype, current)

    def _remove(self, rtype: ResourceType, key: ObjectKey, last: dict[str, Any]) -> None:
        self.objects.pop(key, None)
        for intent_key in [k for k in self.applied_intents if k[0] == key]:
            del self.applied_intents[intent_key]
        gone = copy.deepcopy(last)
        gone["metadata"]["resourceVersion"] = str(self._next_revision())
        self._emit(rtype, "DELETED", gone, last)
        if rtype.plural == "customresourcedefinitions" and rtype.group == "apiextensions.k8s.io":
            for stale in resource_types_from_crd(last):
                for object_key in [k for k in self.objects if k[:2] == (stale.group, stale.plural)]:
                    self._remove(stale, object_key, self.objects[object_key])
                self.types.pop((stale.group, stale.version, stale.plural), None)
        self._collect_garbage(last["metadata"]["uid"])

    def _collect_garbage(self, owner_uid: str) -> None:
        """Background cascading deletion: dependents whose owners are all gone go too."""
        live_uids = {obj["metadata"]["uid"] for obj in self.objects.values()}
        for key, obj in list(self.objects.items()):
            owners = obj["metadata"].get("ownerReferences") or []
            if owner_uid in {ref.get("uid") for ref in owners} and not any(
                ref.get("uid") in live_uids for ref in owners
            ):
                rtype = self._type_of(key)
                if rtype is not None and key in self.objects:
                    self.delete(rtype, key[2] or None, key[3])

    def _finish_namespace(self, namespace: str) -> None:
        for key in [k for k in self.objects if k[2] == namespace]:
            rtype = self._type_of(key)
            if rtype is not None and key in self.objects:
                self.delete(rtype, namespace, key[3])
        ns_key = ("", "namespaces", "", namespace)
        ns = self.objects.get(ns_key)
        if ns is not None and not ns["metadata"].get("finalizers"):
            self._remove(self.find_type("", "v1", "namespaces"), ns_key, ns)

    def _type_of(self, key: ObjectKey) -> ResourceType | None:
        candidates = [t for (g, _, p), t in self.types.items() if (g, p) == key[:2]]
        return (
            sorted(candidates, key=lambda t: _version_priority(t.version))[0]
            if candidates
            else None
        )

    # --- scale ---------------------------------------------------------------------------

    def scale_of(self, rtype: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
        paths = rtype.scale
        assert paths is not None
        if paths.label_selector is None:
            selector = selector_string(get_path(obj, ".spec.selector"))
        else:
            selector = get_path(obj, paths.label_selector) or ""
        metadata = obj["metadata"]
        status: dict[str, Any] = {"replicas": get_path(obj, paths.status_replicas) or 0}
        if selector:
            status["selector"] = selector
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {
                k: metadata[k]
                for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                if k in metadata
            },
            "spec": {"replicas": get_path(obj, paths.spec_replicas) or 0},
            "status": status,
        }

    # --- server-side apply ---------------------------------------------------------------

    def apply(
        self,
        rtype: ResourceType,
        namespace: str | None,
        name: str,
        intent: dict[str, Any],
        manager: str,
        *,
        subresource: str | None,
        strict_fields: bool = False,
        dry_run: bool = False,
    ) -> tuple[dict[str, Any], bool]:
        key = self.key(rtype, namespace, name)
        intent = copy.deepcopy(intent)
        intent.setdefault("metadata", {})["name"] = name
        if key not in self.objects:
            created = self.create(
                rtype, namespace, intent, strict_fields=strict_fields, dry_run=dry_run
            )
            if not dry_run:
                self.applied_intents[(key, manager)] = intent
            return created, True
        previous = self.applied_intents.get((key, manager))
        result = self.update(
            rtype,
            namespace,
            name,
            lambda live: server_side_apply(live, previous, intent),
            subresource=subresource,
            strict_fields=strict_fields,
            dry_run=dry_run,
            expected_version=(intent.get("metadata") or {}).get("resourceVersion"),
        )
        if not dry_run:
            self.applied_intents[(key, manager)] = intent
        return result, False


def _version_priority(version: str) -> tuple[int, int, int]:
    """Kubernetes' version order: GA before beta before alpha, higher numbers first."""
    match = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", version)
    if not match:
        return (3, 0, 0)
    major, stage, minor = match.groups()
    return ({None: 0, "beta": 1, "alpha": 2}[stage], -int(major), -int(minor or 0))


def _without_revision(obj: dict[str, Any]) -> dict[str, Any]:
    return {
        **obj,
        "metadata": {k: v for k, v in obj.get("metadata", {}).items() if k != "resourceVersion"},
    }


def _spec_changed(rtype: ResourceType, old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether the generation moves: any change outside metadata and (with a status
    subresource) status, or the start of a graceful deletion."""
    ignored = {"metadata", "status"} if rtype.has_status else {"metadata"}
    old_rest = {k: v for k, v in old.items() if k not in ignored}
    new_rest = {k: v for k, v in new.items() if k not in ignored}
    return old_rest != new_rest


# ---------------------------------------------------------------------------------------------
# HTTP


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
        raise ApiError(404, "NotFound", "the server could not find the requested resource")
    return ResourceRequest(rtype, namespace, name, subresource)


def _json(data: Any, status: int = 200, content_type: str = "application/json") -> web.Response:
    return web.Response(text=json.dumps(data), status=status, content_type=content_type)


def _wants_table(request: web.Request) -> bool:
    return "as=Table" in request.headers.get("Accept", "")


def _truthy(value: str | None) -> bool:
    return value in ("true", "1", "True")


class EmulatorServer:
    """The REST face of a KubeEmulator."""

    def __init__(
        self, emulator: KubeEmulator | None = None, *, bookmark_interval: float = 30.0
    ) -> None:
        self.emulator = emulator or KubeEmulator()
        self.bookmark_interval = bookmark_interval
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        self.app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner: web.AppRunner | None = None
        self.url = ""
        self._stopping = asyncio.Event()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self.runner = web.AppRunner(self.app, handle_signals=False, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        sockets = site._server.sockets  # type: ignore[union-attr]
        self.url = f"http://{host}:{sockets[0].getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        self._stopping.set()
        for watcher in self.emulator.watchers:
            watcher.queue.put_nowait(None)  # end open watches now, not at their next timeout
        if self.runner is not None:
            await self.runner.cleanup()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._dispatch(request)
        except ApiError as error:
            return _json(error.as_status(), status=error.code)
        except (json.JSONDecodeError, yaml.YAMLError) as error:
            return _json(bad_request(f"invalid body: {error}").as_status(), status=400)

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:  # noqa: C901 (to split)
        path = request.path.rstrip("/") or "/"
        method = request.method
        if method == "GET":
            static = self._non_resource(path)
            if static is not None:
                return static
        resource = parse_resource_path(self.emulator, path)
        if resource is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        query = request.query
        strict = query.get("fieldValidation") == "Strict"
        dry_run = query.get("dryRun") == "All"
        rtype, namespace, name, sub = (
            resource.rtype,
            resource.namespace,
            resource.name,
            resource.subresource,
        )
        em = self.emulator

        if method == "GET" and name is None:
            selection = Selection(
                namespace,
                parse_label_selector(query.get("labelSelector", "")),
                parse_field_selector(query.get("fieldSelector", "")),
            )
            if _truthy(query.get("watch")):
                return await self._watch(request, rtype, selection)
            items = em.list(rtype, selection)
            if _wants_table(request):
                return _json(self._table(rtype, items, query))
            return _json(
                {
                    "kind": f"{rtype.kind}List",
                    "apiVersion": rtype.api_version,
                    "metadata": {"resourceVersion": str(em.revision)},
                    "items": items,
                }
            )
        if name is None and method == "POST":
            body = await self._body(request)
            created = em.create(rtype, namespace, body, strict_fields=strict, dry_run=dry_run)
            return _json(created, status=201)
        if name is None and method == "DELETE":
            selection = Selection(
                namespace,
                parse_label_selector(query.get("labelSelector", "")),
                parse_field_selector(query.get("fieldSelector", "")),
            )
            deleted = [
                em.delete(rtype, namespace, item["metadata"]["name"], dry_run=dry_run)
                for item in em.list(rtype, selection)
            ]
            return _json(
                {
                    "kind": f"{rtype.kind}List",
                    "apiVersion": rtype.api_version,
                    "metadata": {"resourceVersion": str(em.revision)},
                    "items": deleted,
                }
            )
        if name is None:
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported here")

        if method == "GET":
            obj = em.get(rtype, namespace, name)
            if sub == SCALE_SUBRESOURCE:
                return _json(em.scale_of(rtype, obj))
            if _wants_table(request):
                return _json(self._table(rtype, [obj], query))
            return _json(obj)
        if method == "DELETE":
            obj = em.delete(rtype, namespace, name, dry_run=dry_run)
            return _json(obj)
        if method == "PUT":
            body = await self._body(request)
            if sub == SCALE_SUBRESOURCE:
                return _json(self._write_scale(rtype, namespace, name, lambda _: body, strict))
            result = em.update(
                rtype,
                namespace,
                name,
                lambda _: body,
                subresource=sub,
                strict_fields=strict,
                dry_run=dry_run,
            )
            return _json(result)
        if method == "PATCH":
            return await self._patch(request, resource, strict, dry_run)
        if method == "POST":
            raise ApiError(405, "MethodNotAllowed", f"POST to {sub} is not supported")
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported")

    async def _patch(  # noqa: C901 (to split)
        self, request: web.Request, resource: ResourceRequest, strict: bool, dry_run: bool
    ) -> web.Response:
        em = self.emulator
        rtype, namespace, name, sub = (
            resource.rtype,
            resource.namespace,
            resource.name,
            resource.subresource,
        )
        assert name is not None
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        text = await request.text()
        if content_type == "application/apply-patch+yaml":
            intent = yaml.safe_load(text) or {}
            manager = request.query.get("fieldManager")
            if not manager:
                raise bad_request("PATCH of type apply requires a fieldManager")
            if sub == SCALE_SUBRESOURCE:
                return _json(
                    self._write_scale(
                        rtype, namespace, name, lambda scale: _deep_merge(scale, intent), strict
                    )
                )
            result, created = em.apply(
                rtype,
                namespace,
                name,
                intent,
                manager,
                subresource=sub,
                strict_fields=strict,
                dry_run=dry_run,
            )
            return _json(result, status=201 if created else 200)
        patch = json.loads(text or "null")
        if content_type == "application/json-patch+json":

            def change(current: dict[str, Any]) -> dict[str, Any]:
                try:
                    return json_patch(current, patch)
                except JsonPatchTestFailed as failed:
                    raise invalid(rtype, name, [(str(failed), "test operation failed")]) from None
                except (KeyError, IndexError, ValueError, TypeError) as error:
                    raise invalid(rtype, name, [(str(error), "path not found")]) from None
        elif content_type == "application/merge-patch+json":

            def change(current: dict[str, Any]) -> dict[str, Any]:
                return merge_patch(current, patch)
        elif content_type == "application/strategic-merge-patch+json":
            if rtype.schema is not None or rtype.group not in {t.group for t in BUILTIN_TYPES}:
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    "strategic merge patch is not supported for custom resources",
                )

            def change(current: dict[str, Any]) -> dict[str, Any]:
                return strategic_merge_patch(current, patch)
        else:
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format: {content_type}",
            )
        if sub == SCALE_SUBRESOURCE:
            return _json(self._write_scale(rtype, namespace, name, change, strict))
        return _json(
            em.update(
                rtype,
                namespace,
                name,
                change,
                subresource=sub,
                strict_fields=strict,
                dry_run=dry_run,
            )
        )

    def _write_scale(
        self,
        rtype: ResourceType,
        namespace: str | None,
        name: str,
        change: Callable[[dict[str, Any]], dict[str, Any]],
        strict: bool,
    ) -> dict[str, Any]:
        em = self.emulator
        paths = rtype.scale
        assert paths is not None
        scale = change(em.scale_of(rtype, em.get(rtype, namespace, name)))
        replicas = (scale.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            raise invalid(rtype, name, [("spec.replicas", "must be a non-negative integer")])

        def set_replicas(current: dict[str, Any]) -> dict[str, Any]:
            set_path(current, paths.spec_replicas, replicas)
            return current

        updated = em.update(
            rtype,
            namespace,
            name,
            set_replicas,
            subresource=None,
            strict_fields=strict,
            expected_version=(scale.get("metadata") or {}).get("resourceVersion"),
        )
        return em.scale_of(rtype, updated)

    @staticmethod
    async def _body(request: web.Request) -> dict[str, Any]:
        text = await request.text()
        if "yaml" in request.headers.get("Content-Type", ""):
            return yaml.safe_load(text) or {}
        return json.loads(text or "{}")

    # --- watch ---------------------------------------------------------------------------

    async def _watch(  # noqa: C901 (to split)
        self, request: web.Request, rtype: ResourceType, selection: Selection
    ) -> web.StreamResponse:
        em = self.emulator
        query = request.query
        since = query.get("resourceVersion", "")
        send_initial = _truthy(query.get("sendInitialEvents"))
        bookmarks = _truthy(query.get("allowWatchBookmarks"))
        timeout = float(query.get("timeoutSeconds") or 1800)
        as_table = _wants_table(request)
        rtype_key = (rtype.group, rtype.plural)

        # Everything up to the registration of the watcher happens without yielding to the
        # event loop, so that no event can fall between the replay and the live stream.
        backlog: list[tuple[str, dict[str, Any]]] = []
        if send_initial or since in ("", "0"):
            backlog = [("ADDED", obj) for obj in em.list(rtype, selection)]
        else:
            start = int(since)
            if (
                em.event_log
                and start < em.event_log[0].resource_version - 1
                and start < em.revision
            ):
                raise ApiError(
                    410,
                    "Expired",
                    f"too old resource version: {start} ({em.event_log[0].resource_version})",
                )
            for event in em.event_log:
                if event.resource_version > start and event.rtype_key == rtype_key:
                    translated = _translate(event, selection)
                    if translated is not None:
                        backlog.append(translated)
        watcher = Watcher(rtype_key, selection, asyncio.Queue())
        em.watchers.append(watcher)
        initial_end_revision = str(em.revision)

        response = web.StreamResponse(
            headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"}
        )
        try:
            await response.prepare(request)

            async def send(event_type: str, obj: dict[str, Any]) -> None:
                payload = (
                    self._table(rtype, [obj], query)
                    if as_table and event_type != "BOOKMARK"
                    else obj
                )
                line = json.dumps({"type": event_type, "object": payload}) + "\n"
                await response.write(line.encode())

            for event_type, obj in backlog:
                await send(event_type, em._view(rtype, obj))
            if send_initial and bookmarks:
                await send("BOOKMARK", _bookmark(rtype, initial_end_revision, initial_end=True))
            deadline = asyncio.get_running_loop().time() + timeout
            while not self._stopping.is_set():
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    break
                try:
                    event = await asyncio.wait_for(
                        watcher.queue.get(), min(remaining, self.bookmark_interval)
                    )
                except asyncio.TimeoutError:
                    if bookmarks:
                        await send("BOOKMARK", _bookmark(rtype, str(em.revision)))
                    continue
                if event is None:
                    break
                translated = _translate(event, selection)
                if translated is not None:
                    await send(translated[0], em._view(rtype, translated[1]))
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            em.watchers.remove(watcher)
        return response

    # --- tables --------------------------------------------------------------------------

    def _table(
        self, rtype: ResourceType, items: list[dict[str, Any]], query: Any
    ) -> dict[str, Any]:
        columns = [
            {
                "name": "Name",
                "type": "string",
                "format": "name",
                "priority": 0,
                "description": "Name must be unique within a namespace.",
            }
        ]
        columns += [
            {
                "name": c.name,
                "type": c.type,
                "format": "",
                "priority": c.priority,
                "description": "",
            }
            for c in rtype.printer_columns
        ]
        has_age = any(c.name == "Age" for c in rtype.printer_columns)
        if not has_age:
            columns.append(
                {
                    "name": "Age",
                    "type": "date",
                    "format": "",
                    "priority": 0,
                    "description": "CreationTimestamp",
                }
            )
        include_object = query.get("includeObject", "PartialObjectMetadata")
        rows = []
        for obj in items:
            cells: list[Any] = [obj["metadata"]["name"]]
            for column in rtype.printer_columns:
                value = get_path(obj, column.json_path)
                if column.type == "date":
                    value = _age(value)
                cells.append("" if value is None else value)
            if not has_age:
                cells.append(_age(obj["metadata"].get("creationTimestamp")))
            row_object = (
                obj
                if include_object == "Object"
                else {
                    "kind": "PartialObjectMetadata",
                    "apiVersion": TABLE_GROUP_VERSION,
                    "metadata": obj["metadata"],
                }
            )
            rows.append({"cells": cells, "object": row_object})
        return {
            "kind": "Table",
            "apiVersion": TABLE_GROUP_VERSION,
            "metadata": {"resourceVersion": str(self.emulator.revision)},
            "columnDefinitions": columns,
            "rows": rows,
        }

    # --- discovery and OpenAPI ----------------------------------------------------------

    def _non_resource(self, path: str) -> web.Response | None:  # noqa: C901 (to split)
        em = self.emulator
        groups = em.groups()
        if path == "/version":
            return _json(KUBERNETES_VERSION)
        if path in ("/healthz", "/livez", "/readyz"):
            return web.Response(text="ok")
        if path == "/api":
            return _json(
                {
                    "kind": "APIVersions",
                    "versions": ["v1"],
                    "serverAddressByClientCIDRs": [
                        {"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}
                    ],
                }
            )
        if path == "/apis":
            return _json(
                {
                    "kind": "APIGroupList",
                    "apiVersion": "v1",
                    "groups": [_group_info(g, v) for g, v in sorted(groups.items()) if g],
                }
            )
        if path == "/api/v1":
            return _json(self._resource_list("", "v1"))
        parts = [p for p in path.split("/") if p]
        if parts[:1] == ["apis"] and len(parts) == 2:
            if parts[1] not in groups:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            return _json(
                {"kind": "APIGroup", "apiVersion": "v1", **_group_info(parts[1], groups[parts[1]])}
            )
        if parts[:1] == ["apis"] and len(parts) == 3:
            if parts[2] not in groups.get(parts[1], []):
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            return _json(self._resource_list(parts[1], parts[2]))
        if path == "/openapi/v3":
            index = {}
            for group, versions in groups.items():
                for version in versions:
                    gv_path = f"apis/{group}/{version}" if group else "api/v1"
                    index[gv_path] = {
                        "serverRelativeURL": f"/openapi/v3/{gv_path}?hash={em.revision}"
                    }
            return _json({"paths": index})
        if path.startswith("/openapi/v3/"):
            gv = path[len("/openapi/v3/") :]
            gv_parts = gv.split("/")
            group, version = (
                ("", gv_parts[1]) if gv_parts[0] == "api" else (gv_parts[1], gv_parts[2])
            )
            return _json(self._openapi_v3(group, version))
        if path.startswith("/openapi/v2"):
            raise ApiError(404, "NotFound", "OpenAPI v2 is not served; use /openapi/v3")
        return None

    def _resource_list(self, group: str, version: str) -> dict[str, Any]:
        resources = []
        for (g, v, _), rtype in sorted(self.emulator.types.items()):
            if (g, v) != (group, version):
                continue
            resources.append(
                {
                    "name": rtype.plural,
                    "singularName": rtype.singular,
                    "namespaced": rtype.namespaced,
                    "kind": rtype.kind,
                    "verbs": [
                        "create",
                        "delete",
                        "deletecollection",
                        "get",
                        "list",
                        "patch",
                        "update",
                        "watch",
                    ],
                    "shortNames": list(rtype.short_names),
                    "categories": list(rtype.categories),
                }
            )
            for sub in sorted(rtype.subresources):
                entry = {
                    "name": f"{rtype.plural}/{sub}",
                    "singularName": "",
                    "namespaced": rtype.namespaced,
                    "kind": rtype.kind,
                    "verbs": ["get", "patch", "update"],
                }
                if sub == SCALE_SUBRESOURCE:
                    entry.update(group="autoscaling", version="v1", kind="Scale")
                resources.append(entry)
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version,
            "resources": resources,
        }

    def _openapi_v3(self, group: str, version: str) -> dict[str, Any]:
        """Just enough OpenAPI for kubectl: each resource's PATCH declares fieldValidation, so
        kubectl leaves validation to the server (which checks custom resources here)."""
        paths = {}
        for (g, v, _), rtype in self.emulator.types.items():
            if (g, v) != (group, version):
                continue
            prefix = rtype.group_version_path.lstrip("/")
            scope = "namespaces/{namespace}/" if rtype.namespaced else ""
            gvk = {"group": g, "version": v, "kind": rtype.kind}
            paths[f"/{prefix}/{scope}{rtype.plural}/{{name}}"] = {
                "patch": {
                    "x-kubernetes-group-version-kind": gvk,
                    "x-kubernetes-action": "patch",
                    "parameters": [
                        {"name": "fieldValidation", "in": "query", "schema": {"type": "string"}}
                    ],
                    "responses": {"200": {"description": "OK"}},
                },
            }
        return {
            "openapi": "3.0.0",
            "info": {"title": "Kubernetes", "version": "v1.32.0"},
            "paths": paths,
            "components": {"schemas": {}},
        }


def _group_info(group: str, versions: list[str]) -> dict[str, Any]:
    return {
        "name": group,
        "versions": [{"groupVersion": f"{group}/{v}", "version": v} for v in versions],
        "preferredVersion": {"groupVersion": f"{group}/{versions[0]}", "version": versions[0]},
    }


def _bookmark(rtype: ResourceType, revision: str, initial_end: bool = False) -> dict[str, Any]:
    metadata: dict[str, Any] = {"resourceVersion": revision}
    if initial_end:
        metadata["annotations"] = {"k8s.io/initial-events-end": "true"}
    return {"kind": rtype.kind, "apiVersion": rtype.api_version, "metadata": metadata}


def _translate(event: WatchEvent, selection: Selection) -> tuple[str, dict[str, Any]] | None:
    """What a watcher with a selector sees: objects moving into or out of the selection show
    up as ADDED or DELETED."""
    now_matches = selection.matches(event.obj)
    before_matched = event.old is not None and selection.matches(event.old)
    if event.type == "DELETED":
        return ("DELETED", event.obj) if now_matches else None
    if now_matches and not before_matched:
        return ("ADDED", event.obj)
    if now_matches:
        return (event.type, event.obj)
    if before_matched:
        return ("DELETED", event.obj)
    return None


# ---------------------------------------------------------------------------------------------
# Running it


def kubeconfig_text(server_url: str, namespace: str = "default") -> str:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulator", "cluster": {"server": server_url}}],
        "users": [{"name": "emulator", "user": {"token": "emulator"}}],
        "contexts": [
            {
                "name": "emulator",
                "context": {"cluster": "emulator", "user": "emulator", "namespace": namespace},
            }
        ],
        "current-context": "emulator",
    }
    return yaml.safe_dump(config)


class EmulatorThread:
    """The emulator on a loopback port, served from a thread (for tests)."""

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, *, bookmark_interval: float = 30.0
    ) -> None:
        self.host, self.port = host, port
        self.server = EmulatorServer(bookmark_interval=bookmark_interval)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="kube-emulator", daemon=True
        )
        self.url = ""

    def __enter__(self) -> EmulatorThread:
        self.thread.start()
        self.url = self.call(self.server.start(self.host, self.port))
        return self

    def __exit__(self, *exc: object) -> None:
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    def call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=30)

    @property
    def emulator(self) -> KubeEmulator:
        return self.server.emulator


async def _serve_forever(host: str, port: int, kubeconfig: Path | None) -> None:
    server = EmulatorServer()
    url = await server.start(host, port)
    if kubeconfig is not None:
        kubeconfig.write_text(kubeconfig_text(url))
    print(f"kube emulator listening on {url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--kubeconfig", type=Path, help="write a kubeconfig for this server")
    args = parser.parse_args(argv)
    asyncio.run(_serve_forever(args.host, args.port, args.kubeconfig))
    return 0


if __name__ == "__main__":
    sys.exit(main())
