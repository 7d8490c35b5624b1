"""msgpack forms of typed data classes, derived from their type hints and checked on the way in.

A data class travels as the list of its init fields in declaration order; ``list[int]`` fields
(token ids, block ids, sequence ids) travel as raw little-endian int64 bytes, which is both
compact and fast to pack. Decoding rebuilds the class through its constructor, so a class that
validates itself (``SamplingParams``) validates what arrives. Anything that does not fit the
schema raises ``WireError``; nothing is ever unpickled.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
import types
import typing
from collections.abc import Callable
from typing import Any

Encode = Callable[[Any], Any]
Decode = Callable[[Any], Any]


class WireError(ValueError):
    """A message that does not match its schema."""


def _fail(expected: str, value: Any) -> WireError:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return WireError(f"expected {expected}, got {type(value).__name__} {shown}")


@functools.cache
def encoder(tp: Any) -> Encode:
    """The function turning a value of type ``tp`` into msgpack-able data."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in (int, float, bool, str, bytes, type(None)):
        return float if tp is float else _identity
    if origin is list and args == (int,):
        return _encode_ids
    if origin is list:
        item = encoder(args[0])
        return lambda value: [item(v) for v in value]
    if origin is tuple:
        items = [encoder(a) for a in args]
        return lambda value: [f(v) for f, v in zip(items, value, strict=True)]
    if origin is dict:
        key, val = encoder(args[0]), encoder(args[1])
        return lambda value: {key(k): val(v) for k, v in value.items()}
    if origin in (typing.Union, types.UnionType):
        return _encode_union(args)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _encode_dataclass(tp)
    raise TypeError(f"no wire form for {tp!r}")


@functools.cache
def decoder(tp: Any) -> Decode:
    """The function checking msgpack data against type ``tp`` and rebuilding the value."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is int:
        return _decode_int
    if tp is float:
        return _decode_float
    if tp in (bool, str, bytes, type(None)):
        return _exact(tp)
    if origin is list and args == (int,):
        return _decode_ids
    if origin is list:
        item = decoder(args[0])

        def decode_list(value: Any) -> list[Any]:
            if not isinstance(value, list):
                raise _fail("a list", value)
            return [item(v) for v in value]

        return decode_list
    if origin is tuple:
        return _decode_tuple([decoder(a) for a in args])
    if origin is dict:
        return _decode_dict(decoder(args[0]), decoder(args[1]))
    if origin in (typing.Union, types.UnionType):
        return _decode_union(args)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _decode_dataclass(tp)
    raise TypeError(f"no wire form for {tp!r}")


def _identity(value: Any) -> Any:
    return value


def _encode_ids(value: list[int]) -> bytes:
    try:
        return struct.pack(f"<{len(value)}q", *value)
    except struct.error as error:
        raise TypeError(f"ids must be int64 values: {error}") from None


def _decode_ids(value: Any) -> list[int]:
    if not isinstance(value, bytes) or len(value) % 8:
        raise _fail("int64 bytes", value)
    return list(struct.unpack(f"<{len(value) // 8}q", value))


def _decode_int(value: Any) -> int:
    if type(value) is not int:
        raise _fail("an int", value)
    return value


def _decode_float(value: Any) -> float:
    if type(value) not in (float, int):
        raise _fail("a float", value)
    return float(value)


def _exact(tp: type) -> Decode:
    def decode(value: Any) -> Any:
        if type(value) is not tp:
            raise _fail(tp.__name__, value)
        return value

    return decode


def _decode_tuple(items: list[Decode]) -> Decode:
    def decode(value: Any) -> tuple[Any, ...]:
        if not isinstance(value, list) or len(value) != len(items):
            raise _fail(f"a list of {len(items)}", value)
        return tuple(f(v) for f, v in zip(items, value, strict=True))

    return decode


def _decode_dict(key: Decode, val: Decode) -> Decode:
    def decode(value: Any) -> dict[Any, Any]:
        if not isinstance(value, dict):
            raise _fail("a map", value)
        return {key(k): val(v) for k, v in value.items()}

    return decode


def _encode_union(args: tuple[Any, ...]) -> Encode:
    if len(args) == 2 and type(None) in args:
        inner = encoder(args[0] if args[1] is type(None) else args[1])
        return lambda value: None if value is None else inner(value)
    arms = [(typing.get_origin(a) or a, encoder(a)) for a in args]

    def encode(value: Any) -> Any:
        kind = type(value)
        for base, f in arms:
            if kind is base or (base is float and kind is int):
                return f(value)
        for base, f in arms:
            if isinstance(value, base) and kind is not bool:
                return f(value)
        raise TypeError(f"{value!r} is none of {args}")

    return encode


# The msgpack types each kind of schema type can arrive as, for picking a union's arm.
def _wire_types(tp: Any) -> tuple[type, ...]:
    origin = typing.get_origin(tp) or tp
    if origin is list and typing.get_args(tp) == (int,):
        return (bytes,)
    if origin in (list, tuple) or dataclasses.is_dataclass(origin):
        return (list,)
    if origin is float:
        return (float, int)
    return (origin,)


def _decode_union(args: tuple[Any, ...]) -> Decode:
    if len(args) == 2 and type(None) in args:
        inner = decoder(args[0] if args[1] is type(None) else args[1])
        return lambda value: None if value is None else inner(value)
    arms = [(_wire_types(a), decoder(a)) for a in args]
    expected = " or ".join(getattr(a, "__name__", str(a)) for a in args)

    def decode(value: Any) -> Any:
        kind = type(value)
        for wire_types, f in arms:
            if kind in wire_types:
                return f(value)
        raise _fail(expected, value)

    return decode


def _wire_fields(cls: type) -> list[tuple[str, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls) if f.init]


def _encode_dataclass(cls: type) -> Encode:
    fields = [(name, encoder(tp)) for name, tp in _wire_fields(cls)]
    # Scalars go as they are, which saves a call per field on the hot path.
    plain = [name for name, f in fields if f is _identity]
    if len(plain) == len(fields):
        return lambda value: [getattr(value, name) for name in plain]

    def encode(value: Any) -> list[Any]:
        return [f(getattr(value, name)) for name, f in fields]

    return encode


def _decode_dataclass(cls: type) -> Decode:
    fields = _wire_fields(cls)
    decoders = [decoder(tp) for _, tp in fields]
    count = len(fields)

    def decode(value: Any) -> Any:
        if type(value) is not list or len(value) != count:
            raise _fail(f"{cls.__name__} as a list of {count} fields", value)
        args = []
        try:
            for f, v in zip(decoders, value, strict=True):
                args.append(f(v))
        except WireError as error:
            raise WireError(f"{cls.__name__}.{fields[len(args)][0]}: {error}") from None
        try:
            return cls(*args)
        except (ValueError, TypeError) as error:
            raise WireError(f"invalid {cls.__name__}: {error}") from None

    return decode
