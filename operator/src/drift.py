"""Whether a live child already is what the operator would apply (pure functions), so that a
resync at steady state writes nothing.

Two checks, together what server-side apply would change:
- the live object holds every field the manifest sets, with the same value (fields the API
  server or others add, such as defaults, do not count: server-side apply leaves them too);
- the live object carries the fingerprint of this very manifest in an annotation (as kubectl's
  last-applied-configuration does): a field the operator stopped setting, which apply would
  remove, changes the fingerprint even though the rest of the manifest is still live."""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from pagedllm.operator.spec import InvalidSpec, parse_quantity

APPLIED_ANNOTATION = "pagedllm.io/applied-fingerprint"

# Set in the manifest but not in list items of a real API server (typed lists leave them out).
_TYPE_FIELDS = ("apiVersion", "kind")


def fingerprint(manifest: Mapping[str, Any]) -> str:
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def stamped(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest to apply: itself with its fingerprint in an annotation."""
    result = copy.deepcopy(dict(manifest))
    metadata = result.setdefault("metadata", {})
    metadata["annotations"] = {
        **(metadata.get("annotations") or {}),
        APPLIED_ANNOTATION: fingerprint(manifest),
    }
    return result


# Fields holding quantities, which the API server stores in canonical form (cpu: 2 reads
# back "2", 0.5 reads back "500m", 1536Mi reads back "1536Mi" but 1.5Gi does too).
_QUANTITY_PARENTS = frozenset({"limits", "requests"})
_QUANTITY_FIELDS = frozenset({"averageValue"})


def _same_quantity(wanted: Any, live: Any) -> bool:
    if isinstance(wanted, bool) or isinstance(live, bool):
        return False
    if not isinstance(wanted, (int, float, str)) or not isinstance(live, (int, float, str)):
        return False
    try:
        return parse_quantity(wanted) == parse_quantity(live)
    except InvalidSpec:
        return False


def _empty(value: Any) -> bool:
    # The API server drops empty optional fields (omitempty), so {} or [] set may read absent.
    return value is None or value == {} or value == [] or value == ""


def _escape(key: str) -> str:
    """A key as a JSON pointer step (RFC 6901): `nvidia.com/gpu` is `nvidia.com~1gpu`, so that
    the last step of a path is the key itself."""
    return key.replace("~", "~0").replace("/", "~1")


def _difference(wanted: Any, live: Any, path: str) -> str | None:
    if isinstance(wanted, Mapping):
        if not isinstance(live, Mapping):
            return path or "/"
        for key, value in wanted.items():
            if key not in live:
                if _empty(value):
                    continue
                return f"{path}/{_escape(key)}"
            found = _difference(value, live[key], f"{path}/{_escape(key)}")
            if found is not None:
                return found
        return None
    if isinstance(wanted, list):
        # Lists are compared element by element: the API server adds defaults inside the
        # elements (a container's imagePullPolicy) but never adds or reorders elements.
        if not isinstance(live, list) or len(wanted) != len(live):
            return path
        for index, (item, live_item) in enumerate(zip(wanted, live, strict=True)):
            found = _difference(item, live_item, f"{path}/{index}")
            if found is not None:
                return found
        return None
    if wanted == live:
        return None
    parent, _, key = path.rpartition("/")
    in_quantity = key in _QUANTITY_FIELDS or parent.rpartition("/")[2] in _QUANTITY_PARENTS
    return None if in_quantity and _same_quantity(wanted, live) else path


def first_difference(manifest: Mapping[str, Any], live: Mapping[str, Any] | None) -> str | None:
    """The first field (a JSON pointer) where `live` differs from what applying the stamped
    `manifest` would make it, "" when there is no live object, None when applying it would
    change nothing."""
    if live is None:
        return ""
    wanted = {key: value for key, value in manifest.items() if key not in _TYPE_FIELDS}
    return _difference(wanted, live, "")
