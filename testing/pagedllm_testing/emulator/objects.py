"""Small pure helpers on objects: timestamps and dotted field paths."""

from __future__ import annotations

import datetime
import re
from typing import Any

from pagedllm.operator.kube import now_rfc3339 as now_rfc3339


def age(timestamp: str | None) -> str:
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
