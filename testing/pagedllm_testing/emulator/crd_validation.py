"""What the API server does with a custom resource's openAPIV3Schema: defaulting,
pruning, structural validation and CEL rules (x-kubernetes-validations).

Used by the API emulator (so that `kubectl apply` of a bad resource is rejected the way a
real cluster rejects it) and by the tests that check the CRD's schema.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

import celpy
import celpy.celtypes as celtypes
import jsonschema

# The keys of a structural schema that jsonschema must not interpret (Kubernetes extensions
# and OpenAPI-only words); the rest is plain JSON Schema.
_KUBERNETES_ONLY_KEYS = {
    "nullable",
    "default",
    "example",
    "externalDocs",
    "x-kubernetes-validations",
}


@dataclass(frozen=True)
class FieldError:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Fill in `default`s the way the API server does: for absent properties of present objects,
    recursively, defaults themselves defaulted."""
    if isinstance(value, dict) and schema.get("type") == "object":
        result = dict(value)
        for name, sub in schema.get("properties", {}).items():
            if name not in result and "default" in sub:
                result[name] = copy.deepcopy(sub["default"])
            if name in result:
                result[name] = apply_defaults(sub, result[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            known = set(schema.get("properties", {}))
            for name in list(result):
                if name not in known:
                    result[name] = apply_defaults(extra, result[name])
        return result
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], item) for item in value]
    return value


def unknown_fields(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Paths of fields the schema does not declare (those a real server prunes, or rejects
    with fieldValidation=Strict)."""
    found: list[str] = []
    if schema.get("x-kubernetes-preserve-unknown-fields") or schema.get(
        "x-kubernetes-embedded-resource"
    ):
        return found
    if isinstance(value, dict) and schema.get("type") == "object":
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for name, item in value.items():
            if not path and name == "metadata":
                continue  # ObjectMeta is the API server's, whatever the schema says
            if name in properties:
                found += unknown_fields(properties[name], item, f"{path}.{name}")
            elif isinstance(extra, dict):
                found += unknown_fields(extra, item, f"{path}.{name}")
            elif extra is not True:
                found.append(f"{path}.{name}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            found += unknown_fields(schema["items"], item, f"{path}[{index}]")
    return found


def prune(schema: dict[str, Any], value: Any) -> Any:
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return value
    if isinstance(value, dict) and schema.get("type") == "object":
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        result = {}
        for name, item in value.items():
            if name in properties:
                result[name] = prune(properties[name], item)
            elif isinstance(extra, dict):
                result[name] = prune(extra, item)
            elif extra is True:
                result[name] = item
        return result
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune(schema["items"], item) for item in value]
    return value


def _as_json_schema(schema: Any) -> Any:
    if isinstance(schema, dict):
        converted = {
            key: _as_json_schema(item)
            for key, item in schema.items()
            if key not in _KUBERNETES_ONLY_KEYS
        }
        if schema.get("x-kubernetes-int-or-string"):
            converted.pop("type", None)
            converted["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        if schema.get("nullable") and "type" in converted:
            converted["type"] = [converted["type"], "null"]
        # OpenAPI 3.0 spells exclusive bounds as booleans beside minimum/maximum.
        for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
            if converted.get(exclusive) is True:
                converted[exclusive] = converted.pop(bound)
            elif converted.get(exclusive) is False:
                del converted[exclusive]
        return converted
    if isinstance(schema, list):
        return [_as_json_schema(item) for item in schema]
    return schema


def schema_errors(schema: dict[str, Any], value: Any) -> list[FieldError]:
    validator = jsonschema.Draft7Validator(_as_json_schema(schema))
    errors = []
    for error in sorted(validator.iter_errors(value), key=lambda e: list(e.path)):
        path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error.path)
        errors.append(FieldError(path or ".", error.message))
    return errors


class _Absent:
    """oldSelf of an `optionalOldSelf` rule when there is no old object (a create)."""


def _has_value(value: Any) -> celtypes.BoolType:
    return celtypes.BoolType(not isinstance(value, _Absent))


def _value(value: Any) -> Any:
    return value


# The parts of the Kubernetes CEL libraries our rules use that cel-python lacks.
_CEL_FUNCTIONS = {"hasValue": _has_value, "value": _value}
_CEL_ENVIRONMENT = celpy.Environment()
_COMPILED: dict[str, Any] = {}


def _program(rule: str) -> Any:
    if rule not in _COMPILED:
        _COMPILED[rule] = _CEL_ENVIRONMENT.program(
            _CEL_ENVIRONMENT.compile(rule), functions=_CEL_FUNCTIONS
        )
    return _COMPILED[rule]


def _cel_value(schema: dict[str, Any], value: Any) -> Any:
    """JSON to CEL the way the API server types it: by the schema (a `number` is a double
    even when written as 2)."""
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        return celtypes.MapType(
            {
                celtypes.StringType(key): _cel_value(
                    properties.get(key) or (extra if isinstance(extra, dict) else {}), item
                )
                for key, item in value.items()
            }
        )
    if isinstance(value, list):
        items = schema.get("items") if isinstance(schema.get("items"), dict) else {}
        return celtypes.ListType([_cel_value(items, item) for item in value])
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return celtypes.DoubleType(value)
    return celpy.json_to_cel(value)


_ABSENT = _Absent()


def cel_errors(
    schema: dict[str, Any],
    value: Any,
    old_value: Any = _ABSENT,
    path: str = "",
) -> list[FieldError]:
    """Evaluate every x-kubernetes-validations rule on the value it is attached to.

    Transition rules (those naming oldSelf) run only where an old value exists, unless the
    rule sets optionalOldSelf, as the API server does."""
    errors: list[FieldError] = []
    for validation in schema.get("x-kubernetes-validations", []):
        rule = validation["rule"]
        is_transition = re.search(r"\boldSelf\b", rule) is not None
        activation = {"self": _cel_value(schema, value)}
        if is_transition:
            if isinstance(old_value, _Absent):
                if not validation.get("optionalOldSelf"):
                    continue
                activation["oldSelf"] = _ABSENT
            else:
                activation["oldSelf"] = _cel_value(schema, old_value)
        try:
            passed = bool(_program(rule).evaluate(activation))
        except celpy.CELEvalError as error:
            errors.append(FieldError(path or ".", f"rule {rule!r} failed to evaluate: {error}"))
            continue
        if not passed:
            message = validation.get("message") or f"failed rule: {rule}"
            errors.append(FieldError(path + validation.get("fieldPath", "") or ".", message))

    if isinstance(value, dict):
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for name, item in value.items():
            sub = properties.get(name) or (extra if isinstance(extra, dict) else None)
            if sub is None:
                continue
            old_item = old_value.get(name, _ABSENT) if isinstance(old_value, dict) else _ABSENT
            errors += cel_errors(sub, item, old_item, f"{path}.{name}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            errors += cel_errors(schema["items"], item, _ABSENT, f"{path}[{index}]")
    return errors


def validate(
    schema: dict[str, Any],
    obj: dict[str, Any],
    old_obj: dict[str, Any] | None = None,
) -> list[FieldError]:
    """All the errors the API server reports for a defaulted custom resource."""
    errors = schema_errors(schema, obj)
    if errors:
        return errors
    return cel_errors(schema, obj, old_obj if old_obj is not None else _ABSENT)
