"""The patch types of the API: JSON (RFC 6902), merge (RFC 7386), strategic merge and
server-side apply."""

from __future__ import annotations

import copy
from typing import Any


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# The list merge keys Kubernetes' strategic merge patch uses, most specific first.
_MERGE_KEYS = ("mountPath", "containerPort", "uid", "type", "name", "ip", "devicePath")


def _merge_key(items: list[Any]) -> str | None:
    dicts = [item for item in items if isinstance(item, dict)]
    if not dicts or len(dicts) != len(items):
        return None
    for key in _MERGE_KEYS:
        if all(key in item for item in dicts if item.get("$patch") != "replace"):
            return key
    return None


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Strategic merge patch without the Go type information: lists of objects merge on the
    first well-known key (name, containerPort, ...) all their items carry; other lists are
    replaced. Honours the $patch, $retainKeys, $deleteFromPrimitiveList and
    $setElementOrder directives kubectl sends."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: v for k, v in patch.items() if k != "$patch"}
    if patch.get("$patch") == "delete":
        return None
    result = dict(target) if isinstance(target, dict) else {}
    retain = patch.get("$retainKeys")
    for key, value in patch.items():
        if key.startswith("$setElementOrder/") or key in ("$retainKeys", "$patch"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            result[name] = [x for x in result.get(name, []) if x not in value]
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and isinstance(result.get(key), list):
            result[key] = _merge_lists(result[key], value)
        elif isinstance(value, list):
            result[key] = [
                {k: v for k, v in item.items() if not k.startswith("$")}
                if isinstance(item, dict)
                else item
                for item in value
                if not (isinstance(item, dict) and item.get("$patch"))
            ]
        else:
            result[key] = strategic_merge_patch(result.get(key), value)
    if retain is not None:
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _merge_lists(current: list[Any], patch: list[Any]) -> list[Any]:
    key = _merge_key(patch)
    if key is None or not all(isinstance(item, dict) for item in current):
        return copy.deepcopy(patch)
    merged = [copy.deepcopy(item) for item in current]
    for item in patch:
        if item.get("$patch") == "replace":
            return [{k: v for k, v in x.items() if k != "$patch"} for x in patch]
        position = next((i for i, x in enumerate(merged) if x.get(key) == item.get(key)), None)
        if item.get("$patch") == "delete":
            if position is not None:
                merged.pop(position)
        elif position is None:
            merged.append(strategic_merge_patch({}, item))
        else:
            merged[position] = strategic_merge_patch(merged[position], item)
    return merged


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    return [part.replace("~1", "/").replace("~0", "~") for part in path.lstrip("/").split("/")]


def _resolve(doc: Any, parts: list[str]) -> Any:
    for part in parts:
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


class JsonPatchTestFailed(Exception):
    pass


def json_patch(doc: Any, operations: list[dict[str, Any]]) -> Any:
    """RFC 6902. Raises JsonPatchTestFailed for a failed `test`, KeyError/IndexError for a bad
    path."""
    doc = copy.deepcopy(doc)
    for operation in operations:
        doc = _apply_operation(doc, operation)
    return doc


def _apply_operation(doc: Any, operation: dict[str, Any]) -> Any:
    """One operation on `doc` (changed in place where it can be); returns the document."""
    op = operation["op"]
    parts = _pointer(operation["path"])
    if op == "test":
        _test(doc, parts, operation)
        return doc
    if op in ("move", "copy"):
        # Both are an `add` of the value at `from`; a move removes it there first.
        source = _pointer(operation["from"])
        value = copy.deepcopy(_resolve(doc, source))
        if op == "move":
            parent = _resolve(doc, source[:-1])
            del parent[int(source[-1]) if isinstance(parent, list) else source[-1]]
        op, operation = "add", {"path": operation["path"], "value": value}
    if not parts:
        return copy.deepcopy(operation.get("value"))
    parent = _resolve(doc, parts[:-1])
    if isinstance(parent, list):
        _change_list(parent, parts[-1], op, operation)
    else:
        _change_map(parent, parts[-1], op, operation)
    return doc


def _test(doc: Any, parts: list[str], operation: dict[str, Any]) -> None:
    try:
        actual = _resolve(doc, parts)
    except (KeyError, IndexError) as error:
        raise JsonPatchTestFailed(operation["path"]) from error
    if actual != operation.get("value"):
        raise JsonPatchTestFailed(operation["path"])


def _change_list(parent: list[Any], last: str, op: str, operation: dict[str, Any]) -> None:
    index = len(parent) if last == "-" else int(last)
    if op == "add":
        parent.insert(index, copy.deepcopy(operation["value"]))
    elif op == "remove":
        parent.pop(index)
    elif op == "replace":
        parent[index] = copy.deepcopy(operation["value"])


def _change_map(parent: dict[str, Any], last: str, op: str, operation: dict[str, Any]) -> None:
    if op in ("remove", "replace") and last not in parent:
        raise KeyError(operation["path"])
    if op == "remove":
        del parent[last]
    else:
        parent[last] = copy.deepcopy(operation["value"])


def _leaf_paths(value: Any, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """The fields a server-side apply intent owns: scalars and lists are atomic leaves."""
    if isinstance(value, dict) and value:
        paths: set[tuple[str, ...]] = set()
        for key, item in value.items():
            paths |= _leaf_paths(item, prefix + (key,))
        return paths
    return {prefix}


def _has_path(obj: Any, path: tuple[str, ...]) -> bool:
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return False
        obj = obj[key]
    return True


def _remove_path(obj: dict[str, Any], path: tuple[str, ...], keep: dict[str, Any]) -> None:
    """Remove a field, then the maps it leaves empty unless `keep` (the new intent) has them."""
    parents = [obj]
    for key in path[:-1]:
        child = parents[-1].get(key)
        if not isinstance(child, dict):
            return
        parents.append(child)
    parents[-1].pop(path[-1], None)
    for depth in range(len(path) - 1, 0, -1):
        if parents[depth] or _has_path(keep, path[:depth]):
            return
        parents[depth - 1].pop(path[depth - 1], None)


def deep_merge(base: Any, overlay: Any) -> Any:
    if isinstance(base, dict) and isinstance(overlay, dict):
        result = dict(base)
        for key, value in overlay.items():
            result[key] = deep_merge(base.get(key), value)
        return result
    return copy.deepcopy(overlay)


def server_side_apply(
    live: dict[str, Any], previous_intent: dict[str, Any] | None, intent: dict[str, Any]
) -> dict[str, Any]:
    """Apply an intent for one field manager: fields it applied before and dropped now are
    removed, the rest is merged in (lists atomically)."""
    result = copy.deepcopy(live)
    if previous_intent is not None:
        for path in _leaf_paths(previous_intent) - _leaf_paths(intent):
            if path[:1] != ("metadata",) or path[:2] in (
                ("metadata", "labels"),
                ("metadata", "annotations"),
            ):
                _remove_path(result, path, intent)
    return deep_merge(result, intent)
