"""The emulated cluster's state and the API operations on it (no HTTP here): objects,
revisions, the event log watches replay, and what the API server's own controllers do at
once (CRD establishment, namespace termination, garbage collection)."""

from __future__ import annotations

import asyncio
import copy
import uuid
from collections.abc import Callable
from typing import Any

from pagedllm_testing.emulator import crd_validation
from pagedllm_testing.emulator.errors import (
    ApiError,
    already_exists,
    bad_request,
    conflict,
    invalid,
    no_such_resource,
    not_found,
)
from pagedllm_testing.emulator.events import Watcher, WatchEvent
from pagedllm_testing.emulator.objects import get_path, now_rfc3339
from pagedllm_testing.emulator.patches import server_side_apply
from pagedllm_testing.emulator.resources import (
    BUILTIN_TYPES,
    INITIAL_NAMESPACES,
    STATUS_SUBRESOURCE,
    ResourceType,
    resource_types_from_crd,
    version_priority,
)
from pagedllm_testing.emulator.selectors import Selection, selector_string

EVENT_LOG_LIMIT = 20_000
NAMESPACE_CLEANUP_DELAY = 1.0  # seconds a deleted namespace stays Terminating
GARBAGE_COLLECTION_DELAY = 0.2  # seconds before a dependent of a deleted owner goes

ObjectKey = tuple[str, str, str, str]  # group, plural, namespace ("" if cluster-wide), name


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
            raise no_such_resource()
        return rtype

    def groups(self) -> dict[str, list[str]]:
        """Group -> served versions, preferred first."""
        result: dict[str, list[str]] = {}
        for group, version, _ in self.types:
            versions = result.setdefault(group, [])
            if version not in versions:
                versions.append(version)
        for versions in result.values():
            versions.sort(key=version_priority)
        return result

    def types_in(self, group: str, version: str) -> list[ResourceType]:
        """The kinds served in one group version, by plural."""
        return [t for (g, v, _), t in sorted(self.types.items()) if (g, v) == (group, version)]

    # --- reading -------------------------------------------------------------------------

    @staticmethod
    def key(rtype: ResourceType, namespace: str | None, name: str) -> ObjectKey:
        return (rtype.group, rtype.plural, (namespace or "") if rtype.namespaced else "", name)

    def get(self, rtype: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        obj = self.objects.get(self.key(rtype, namespace, name))
        if obj is None:
            raise not_found(rtype, name)
        return self.view(rtype, obj)

    def list(self, rtype: ResourceType, selection: Selection) -> list[dict[str, Any]]:
        return [
            self.view(rtype, obj)
            for (group, plural, _, _), obj in sorted(self.objects.items())
            if (group, plural) == (rtype.group, rtype.plural) and selection.matches(obj)
        ]

    def view(self, rtype: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
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
            return self.view(rtype, obj)
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
        return self.view(rtype, obj)

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
        wanted = change(self.view(rtype, current))
        wanted_version = (wanted.get("metadata") or {}).get("resourceVersion")
        expected = expected_version or wanted_version
        if expected and expected != current["metadata"]["resourceVersion"]:
            raise conflict(rtype, name)
        merged = self._restrict_to_subresource(rtype, current, wanted, subresource)
        merged = self._admit(rtype, merged, current, strict_fields)
        if _without_revision(merged) == _without_revision(current):
            return self.view(rtype, current)  # a no-op write changes nothing, not even the RV
        if _spec_changed(rtype, current, merged):
            merged["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
        if dry_run:
            return self.view(rtype, merged)
        merged["metadata"]["resourceVersion"] = str(self._next_revision())
        if merged["metadata"].get("deletionTimestamp") and not merged["metadata"].get("finalizers"):
            self._remove(rtype, key, merged)
            return self.view(rtype, merged)
        self.objects[key] = merged
        self._after_write(rtype, merged, current)
        self._emit(rtype, "MODIFIED", merged, current)
        return self.view(rtype, merged)

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
            return self.view(rtype, current)
        if current["metadata"].get("finalizers") or (
            rtype.plural == "namespaces" and not rtype.group
        ):
            if current["metadata"].get("deletionTimestamp"):
                return self.view(rtype, current)
            marked = copy.deepcopy(current)
            marked["metadata"]["deletionTimestamp"] = now_rfc3339()
            marked["metadata"]["resourceVersion"] = str(self._next_revision())
            self.objects[key] = marked
            self._after_write(rtype, marked, current)
            self._emit(rtype, "MODIFIED", marked, current)
            if rtype.plural == "namespaces" and not rtype.group:
                # Like the namespace controller: Terminating for a moment, then emptied.
                self._later(NAMESPACE_CLEANUP_DELAY, lambda: self._finish_namespace(name))
            return self.view(rtype, marked)
        self._remove(rtype, key, current)
        return self.view(rtype, current)

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
            sorted(candidates, key=lambda t: version_priority(t.version))[0] if candidates else None
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
