"""The OpenAPI v2 document in the protobuf encoding kubectl asks for (gnostic's
`openapi.v2.Document`, application/com.github.proto-openapi.spec.v2@v1.0+protobuf).

Only the messages the emulator's document uses are encoded: the info, the PATCH operations
with their query parameters and vendor extensions, and the definitions' schemas. Field
numbers are those of gnostic's openapiv2/OpenAPIv2.proto."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import yaml

MEDIA_TYPE = "application/com.github.proto-openapi.spec.v2@v1.0+protobuf"

_VARINT, _FIXED64, _LENGTH_DELIMITED = 0, 1, 2


# --- the wire format ------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _key(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _bytes(number: int, payload: bytes) -> bytes:
    return _key(number, _LENGTH_DELIMITED) + _varint(len(payload)) + payload


def _string(number: int, value: str) -> bytes:
    return _bytes(number, value.encode()) if value else b""


def _bool(number: int, value: bool) -> bytes:
    return _key(number, _VARINT) + b"\x01" if value else b""


def _int(number: int, value: int) -> bytes:
    return _key(number, _VARINT) + _varint(int(value)) if value else b""


def _double(number: int, value: float) -> bytes:
    return _key(number, _FIXED64) + struct.pack("<d", float(value))


# --- gnostic's messages -----------------------------------------------------------------------


def _any(number: int, value: Any) -> bytes:
    """An `Any` carries its value as YAML (field 2)."""
    return _bytes(number, _string(2, yaml.safe_dump(value, default_flow_style=True).strip()))


def _named(number: int, name: str, value: bytes) -> bytes:
    return _bytes(number, _string(1, name) + _bytes(2, value))


def _vendor_extensions(number: int, obj: dict[str, Any]) -> bytes:
    return b"".join(
        _bytes(number, _string(1, key) + _any(2, value))
        for key, value in obj.items()
        if key.startswith("x-")
    )


def _strings(number: int, values: list[str]) -> bytes:
    return b"".join(_string(number, str(v)) for v in values)


def _additional_properties(number: int, value: Any) -> bytes:
    if isinstance(value, bool):
        # Inside a oneof a false still has to be written, or nothing is chosen.
        return _bytes(number, _key(2, _VARINT) + (b"\x01" if value else b"\x00"))
    return _bytes(number, _bytes(1, schema(value)))


_SchemaField = Callable[[int, Any], bytes]

_SCHEMA_FIELDS: dict[str, tuple[int, _SchemaField]] = {
    "$ref": (1, _string),
    "format": (2, _string),
    "title": (3, _string),
    "description": (4, _string),
    "default": (5, _any),
    "multipleOf": (6, _double),
    "maximum": (7, _double),
    "exclusiveMaximum": (8, _bool),
    "minimum": (9, _double),
    "exclusiveMinimum": (10, _bool),
    "maxLength": (11, _int),
    "minLength": (12, _int),
    "pattern": (13, _string),
    "maxItems": (14, _int),
    "minItems": (15, _int),
    "uniqueItems": (16, _bool),
    "maxProperties": (17, _int),
    "minProperties": (18, _int),
    "required": (19, _strings),
    "enum": (20, lambda n, values: b"".join(_any(n, v) for v in values)),
    "additionalProperties": (21, _additional_properties),
    "type": (22, lambda n, t: _bytes(n, _strings(1, t if isinstance(t, list) else [t]))),
    "items": (23, lambda n, items: _bytes(n, _bytes(1, schema(items)))),
    "allOf": (24, lambda n, schemas: b"".join(_bytes(n, schema(s)) for s in schemas)),
    "properties": (
        25,
        lambda n, props: _bytes(
            n, b"".join(_named(1, name, schema(s)) for name, s in props.items())
        ),
    ),
    "example": (30, _any),
}


def schema(value: dict[str, Any]) -> bytes:
    """A Schema; JSON Schema keywords Swagger 2.0 lacks (oneOf, anyOf, not) are left out."""
    out = b""
    for key, item in value.items():
        field = _SCHEMA_FIELDS.get(key)
        if field is not None:
            out += field[1](field[0], item)
    return out + _vendor_extensions(31, value)


def _query_parameter(parameter: dict[str, Any]) -> bytes:
    sub_schema = (
        _string(2, parameter["in"]) + _string(4, parameter["name"]) + _string(6, parameter["type"])
    )
    # ParametersItem.parameter -> Parameter.non_body_parameter -> .query_parameter_sub_schema
    return _bytes(1, _bytes(2, _bytes(3, sub_schema)))


def _operation(operation: dict[str, Any]) -> bytes:
    parameters = b"".join(_bytes(8, _query_parameter(p)) for p in operation["parameters"])
    responses = b"".join(
        _named(1, code, _bytes(1, _string(1, response["description"])))
        for code, response in operation["responses"].items()
    )
    return parameters + _bytes(9, responses) + _vendor_extensions(13, operation)


def _path_item(item: dict[str, Any]) -> bytes:
    return _bytes(8, _operation(item["patch"]))


def document(doc: dict[str, Any]) -> bytes:
    """The emulator's v2 document (openapi.v2) as gnostic's Document message."""
    info = _string(1, doc["info"]["title"]) + _string(2, doc["info"]["version"])
    paths = b"".join(_named(2, path, _path_item(item)) for path, item in doc["paths"].items())
    definitions = b"".join(
        _named(1, name, schema(value)) for name, value in doc["definitions"].items()
    )
    return _string(1, doc["swagger"]) + _bytes(2, info) + _bytes(8, paths) + _bytes(9, definitions)
