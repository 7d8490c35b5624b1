"""JSON schemas rewritten before xgrammar compiles them, around one of its faults.

xgrammar (0.2.9) compiles a string with ``minLength`` / ``maxLength`` to a rule that admits
raw control characters, which JSON forbids inside strings, so an output following the grammar
could fail to parse. The same bounds written as a ``pattern`` (``^.{min,max}$``) go through
its JSON-string regex path, which refuses them. (That path takes no escape sequences: a
bounded string is written without quotes and backslashes, still valid JSON.)
"""

from __future__ import annotations

from typing import Any

# With one of these, the string's form is already fixed by something more specific.
_SHAPED = ("pattern", "format", "enum", "const")


def rewrite_schema(schema: Any) -> Any:
    """``schema`` with every length-bounded string's bounds turned into a pattern."""
    if isinstance(schema, list):
        return [rewrite_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: rewrite_schema(value) for key, value in schema.items()}
    if _is_bounded_string(out):
        low = out.pop("minLength", 0)
        high = out.pop("maxLength", None)
        out["pattern"] = f"^.{{{low},{'' if high is None else high}}}$"
    return out


def _is_bounded_string(schema: dict[str, Any]) -> bool:
    bounds = [schema.get("minLength"), schema.get("maxLength")]
    return (
        schema.get("type") == "string"
        and any(b is not None for b in bounds)
        and all(
            b is None or (isinstance(b, int) and not isinstance(b, bool) and b >= 0) for b in bounds
        )
        and not any(key in schema for key in _SHAPED)
    )
