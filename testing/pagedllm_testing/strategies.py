"""Hypothesis strategies for output constraints that a random model can finish within a few
hundred tokens: every string, array and number is bounded."""

from __future__ import annotations

import string
from typing import Any

from hypothesis import strategies as st

NAMES = st.sampled_from(["id", "name", "kind", "size", "tags", "ok", "note", "x"])
WORDS = st.text(alphabet=string.ascii_letters + string.digits + " -_.", min_size=1, max_size=6)


@st.composite
def _integer(draw: st.DrawFn) -> dict[str, Any]:
    low = draw(st.integers(-1000, 1000))
    return {"type": "integer", "minimum": low, "maximum": low + draw(st.integers(0, 500))}


@st.composite
def _number(draw: st.DrawFn) -> dict[str, Any]:
    low = draw(st.integers(-100, 100))
    return {"type": "number", "minimum": low, "maximum": low + draw(st.integers(1, 50))}


@st.composite
def _string(draw: st.DrawFn) -> dict[str, Any]:
    low = draw(st.integers(0, 3))
    return {"type": "string", "minLength": low, "maxLength": low + draw(st.integers(0, 6))}


LEAVES = st.one_of(
    _integer(),
    _number(),
    _string(),
    st.just({"type": "boolean"}),
    st.lists(WORDS, min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
    st.lists(st.integers(-9, 99), min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
)


@st.composite
def _array(draw: st.DrawFn, items: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    low = draw(st.integers(0, 2))
    return {
        "type": "array",
        "items": draw(items),
        "minItems": low,
        "maxItems": low + draw(st.integers(0, 2)),
    }


@st.composite
def _object(draw: st.DrawFn, values: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    names = draw(st.lists(NAMES, min_size=1, max_size=3, unique=True))
    required = [n for n in names if draw(st.booleans())]  # the others are optional
    return {
        "type": "object",
        "properties": {n: draw(values) for n in names},
        "required": required,
        "additionalProperties": False,
    }


def json_schemas() -> st.SearchStrategy[dict[str, Any]]:
    """Objects (the top level) of leaves, arrays and objects, nested at most twice."""
    inner = st.recursive(
        LEAVES, lambda children: st.one_of(_array(children), _object(children)), max_leaves=4
    )
    return _object(inner)


_ATOMS = st.one_of(
    st.sampled_from(list("abcxyz019@.-")).map(lambda c: "\\." if c == "." else c),
    st.sampled_from(["[a-c]", "[0-9]", "[xyz]", "\\d", "[A-Z]"]),
)


@st.composite
def _piece(draw: st.DrawFn) -> str:
    atom = draw(
        st.one_of(
            _ATOMS, st.lists(_ATOMS, min_size=2, max_size=3).map("|".join).map(lambda s: f"({s})")
        )
    )
    low = draw(st.integers(0, 2))
    return atom + draw(st.sampled_from(["", "?", f"{{{low},{low + 2}}}", f"{{{low + 1}}}"]))


def regexes() -> st.SearchStrategy[str]:
    """Concatenations of literals, classes and small alternations with bounded repeats (the
    same meaning in Python's ``re`` and in xgrammar)."""
    return st.lists(_piece(), min_size=1, max_size=5).map("".join)


def choices() -> st.SearchStrategy[list[str]]:
    return st.lists(WORDS, min_size=1, max_size=5, unique=True)
