"""The PagedLLM resource's reference, read from the CRD's OpenAPI v3 schema (crds/pagedllm.yaml):
every field with its type, default, validation and description, one table per object."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from reference_tables import anchored, cell, table

CRD = Path(__file__).resolve().parents[2] / "crds" / "pagedllm.yaml"
# Kubernetes' own fields of every object: the schema only names them.
OWN = {"apiVersion", "kind", "metadata"}


@dataclass(frozen=True)
class Field:
    path: str  # spec.engine.blockSize; an array's items are `[]`: spec.env[].name
    schema: dict[str, Any]
    required: bool


def version_schema() -> tuple[str, dict[str, Any]]:
    """(group/version, the served version's openAPIV3Schema)."""
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    return f"{crd['spec']['group']}/{version['name']}", version["schema"]["openAPIV3Schema"]


def _children(path: str, schema: dict[str, Any]) -> Iterator[Field]:
    required = set(schema.get("required", []))
    for name, child in schema.get("properties", {}).items():
        if not path and name in OWN:
            continue
        field = Field(f"{path}.{name}" if path else name, child, name in required)
        yield field
        yield from _children(field.path, child)
    items = schema.get("items")
    if items and items.get("properties"):
        yield from _children(f"{path}[]", items)


def all_fields() -> list[Field]:
    return list(_children("", version_schema()[1]))


def field_paths() -> set[str]:
    return {f.path for f in all_fields()}


def type_of(schema: dict[str, Any]) -> str:
    if schema.get("x-kubernetes-int-or-string"):
        return "integer or string"
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return "object (any fields)"
    kind = schema.get("type", "")
    if kind == "array":
        return f"array of {type_of(schema.get('items', {}))}"
    if kind == "object" and "additionalProperties" in schema:
        return f"map of {type_of(schema['additionalProperties'])}"
    if "format" in schema:
        return f"{kind} ({schema['format']})"
    return kind


def _bounds(schema: dict[str, Any]) -> Iterator[str]:
    if "minimum" in schema:
        yield ("> " if schema.get("exclusiveMinimum") else "≥ ") + str(schema["minimum"])
    if "maximum" in schema:
        yield ("< " if schema.get("exclusiveMaximum") else "≤ ") + str(schema["maximum"])
    if "minLength" in schema:
        yield f"at least {schema['minLength']} characters"
    if "maxLength" in schema:
        yield f"at most {schema['maxLength']} characters"


def validation(field: Field) -> str:
    """The field's checks as a table cell (code spans keep their `|` and `*`: the table
    extension splits cells outside code spans only)."""
    schema = field.schema
    found = ["required"] if field.required else []
    if "enum" in schema:
        found.append("one of " + ", ".join(f"`{v}`" for v in schema["enum"]))
    found += _bounds(schema)
    pattern = schema.get("pattern") or schema.get("additionalProperties", {}).get("pattern")
    if pattern:
        found.append(f"matches `{pattern}`")
    found += [cell(rule["message"]) for rule in schema.get("x-kubernetes-validations", [])]
    return "; ".join(found)


def _default(schema: dict[str, Any]) -> str:
    if "default" not in schema:
        return "–"
    value = schema["default"]
    return f"`{value if isinstance(value, str) else json.dumps(value)}`"


def page() -> str:
    api_version, root = version_schema()
    fields = all_fields()
    out = [
        "# The PagedLLM resource",
        "",
        f"`apiVersion: {api_version}`, `kind: PagedLLM` (short name `pllm`). Every field of the "
        "CustomResourceDefinition `crds/pagedllm.yaml`, generated from its OpenAPI v3 schema "
        "when the site is built: `kubectl explain pagedllm.spec` reads the same schema. The "
        "[PagedLLM resource](../kubernetes/resource.md) page says what the operator makes of "
        "it.",
        "",
        cell(root.get("description", "")),
        "",
    ]
    rules = [rule["message"] for rule in root.get("x-kubernetes-validations", [])]
    out += [f"- {cell(rule)}" for rule in rules] + [""]
    # One table per object, its own fields only, in the schema's order.
    objects = [""]
    for f in fields:
        if f.schema.get("properties"):
            objects.append(f.path)
        if f.schema.get("items", {}).get("properties"):
            objects.append(f.path + "[]")
    for parent in objects:
        rows = [
            [
                anchored(f.path, f"`{f.path.rpartition('.')[2]}`"),
                type_of(f.schema),
                _default(f.schema),
                validation(f),
                cell(f.schema.get("description", "")),
            ]
            for f in fields
            if f.path.rpartition(".")[0] == parent
        ]
        out += [f"## `{parent}`" if parent else "## Top level", ""]
        out += table(["field", "type", "default", "validation", "description"], rows) + [""]
    return "\n".join(out)


def pages() -> dict[str, str]:
    return {"reference/pagedllm.md": page()}
