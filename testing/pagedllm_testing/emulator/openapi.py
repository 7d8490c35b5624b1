"""The OpenAPI documents kubectl reads: v3 (`/openapi/v3`, one document per group version)
for `kubectl explain` and to learn that the server validates fields itself (each resource's
PATCH declares `fieldValidation`), and v2 (`/openapi/v2`, JSON or protobuf) where v3 is not
used: `kubectl explain --output plaintext-openapiv2`, and kubectl's client-side validation.

Custom resources are published with their CRD's schema, as a real API server does; the
built-in kinds only with their top-level fields (the emulator has no Go types to derive their
schemas from)."""

from __future__ import annotations

import copy
from typing import Any

from pagedllm_testing.emulator.resources import ResourceType

INFO = {"title": "Kubernetes", "version": "v1.32.0"}
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
V3_REFS = "#/components/schemas/"
V2_REFS = "#/definitions/"

API_VERSION_FIELD = {
    "description": "APIVersion defines the versioned schema of this representation of an "
    "object. Servers should convert recognized schemas to the latest internal value, and may "
    "reject unrecognized values.",
    "type": "string",
}
KIND_FIELD = {
    "description": "Kind is a string value representing the REST resource this object "
    "represents. In CamelCase.",
    "type": "string",
}

# The fields of ObjectMeta a user of the emulator meets; a real server lists all of them.
OBJECT_META_SCHEMA: dict[str, Any] = {
    "description": "ObjectMeta is metadata that all persisted resources must have.",
    "type": "object",
    "properties": {
        "name": {"description": "Name must be unique within a namespace.", "type": "string"},
        "generateName": {
            "description": "A prefix the server uses to generate a unique name.",
            "type": "string",
        },
        "namespace": {"description": "The namespace the object is in.", "type": "string"},
        "labels": {
            "description": "Map of string keys and values to organize and select objects.",
            "type": "object",
            "additionalProperties": {"type": "string"},
        },
        "annotations": {
            "description": "Unstructured key value map stored with the object.",
            "type": "object",
            "additionalProperties": {"type": "string"},
        },
        "finalizers": {
            "description": "Must be empty before the object is deleted from the registry.",
            "type": "array",
            "items": {"type": "string"},
        },
        "ownerReferences": {
            "description": "Objects this object depends on.",
            "type": "array",
            "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        },
        "uid": {"description": "Set by the server: unique in time and space.", "type": "string"},
        "resourceVersion": {
            "description": "Set by the server: the version of the object.",
            "type": "string",
        },
        "generation": {
            "description": "Set by the server: the generation of the desired state.",
            "type": "integer",
            "format": "int64",
        },
        "creationTimestamp": {
            "description": "Set by the server: when the object was created.",
            "type": "string",
            "format": "date-time",
        },
        "deletionTimestamp": {
            "description": "Set by the server: when the object is to be deleted.",
            "type": "string",
            "format": "date-time",
        },
    },
}


def definition_name(rtype: ResourceType) -> str:
    """The name a real API server gives the kind's schema: io.k8s.api.apps.v1.Deployment,
    and the reversed group for custom resources (io.pagedllm.v1alpha1.PagedLLM)."""
    if rtype.schema is None:
        short_group = rtype.group.split(".")[0] or "core"
        return f"io.k8s.api.{short_group}.{rtype.version}.{rtype.kind}"
    reversed_group = ".".join(reversed(rtype.group.split(".")))
    return f"{reversed_group}.{rtype.version}.{rtype.kind}"


def kind_schema(rtype: ResourceType, refs: str) -> dict[str, Any]:
    """The kind's schema with the API's own top-level fields; `refs` the prefix of $refs."""
    schema = copy.deepcopy(rtype.schema) if rtype.schema is not None else _builtin_schema(rtype)
    properties = schema.setdefault("properties", {})
    properties["apiVersion"] = {**API_VERSION_FIELD, **properties.get("apiVersion", {})}
    properties["kind"] = {**KIND_FIELD, **properties.get("kind", {})}
    # Swagger 2.0 takes no siblings of a $ref; OpenAPI 3.0 wraps it in allOf to keep them.
    meta_ref = {"$ref": refs + OBJECT_META}
    properties["metadata"] = {
        "description": "Standard object's metadata.",
        **(meta_ref if refs == V2_REFS else {"allOf": [meta_ref]}),
    }
    schema["x-kubernetes-group-version-kind"] = [
        {"group": rtype.group, "version": rtype.version, "kind": rtype.kind}
    ]
    return schema


def _builtin_schema(rtype: ResourceType) -> dict[str, Any]:
    return {
        "description": f"{rtype.kind} (the emulator publishes the top-level fields only).",
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
    }


def _patch_operation(rtype: ResourceType, query_parameter: dict[str, Any]) -> dict[str, Any]:
    return {
        "x-kubernetes-group-version-kind": {
            "group": rtype.group,
            "version": rtype.version,
            "kind": rtype.kind,
        },
        "x-kubernetes-action": "patch",
        "parameters": [{"name": "fieldValidation", "in": "query", **query_parameter}],
        "responses": {"200": {"description": "OK"}},
    }


def _object_path(rtype: ResourceType) -> str:
    scope = "namespaces/{namespace}/" if rtype.namespaced else ""
    return f"{rtype.group_version_path}/{scope}{rtype.plural}/{{name}}"


def v3_index(group_versions: list[tuple[str, str]], revision: int) -> dict[str, Any]:
    index = {}
    for group, version in group_versions:
        gv_path = f"apis/{group}/{version}" if group else f"api/{version}"
        index[gv_path] = {"serverRelativeURL": f"/openapi/v3/{gv_path}?hash={revision}"}
    return {"paths": index}


def v3_group_version(types: list[ResourceType]) -> dict[str, Any]:
    """The document of one group version (`types` are the kinds served in it)."""
    schemas: dict[str, Any] = {OBJECT_META: OBJECT_META_SCHEMA}
    paths = {}
    for rtype in types:
        paths[_object_path(rtype)] = {
            "patch": _patch_operation(rtype, {"schema": {"type": "string"}})
        }
        schemas[definition_name(rtype)] = kind_schema(rtype, V3_REFS)
    return {"openapi": "3.0.0", "info": INFO, "paths": paths, "components": {"schemas": schemas}}


def v2(types: list[ResourceType]) -> dict[str, Any]:
    """The one Swagger 2.0 document of every kind served."""
    definitions: dict[str, Any] = {OBJECT_META: OBJECT_META_SCHEMA}
    paths = {}
    for rtype in types:
        paths[_object_path(rtype)] = {"patch": _patch_operation(rtype, {"type": "string"})}
        definitions[definition_name(rtype)] = _as_v2(kind_schema(rtype, V2_REFS))
    return {"swagger": "2.0", "info": INFO, "paths": paths, "definitions": definitions}


def _as_v2(schema: Any) -> Any:
    """Swagger 2.0 has no `nullable`; a real server drops it from CRD schemas as well."""
    if isinstance(schema, list):
        return [_as_v2(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    return {
        key: _as_v2(value)
        for key, value in schema.items()
        if not (key == "nullable" and isinstance(value, bool))
    }
