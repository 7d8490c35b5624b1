"""Label and field selectors, and which objects a list or watch selects."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pagedllm_testing.emulator.objects import get_path


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: str  # =, !=, in, notin, exists, !exists
    values: tuple[str, ...] = ()

    def matches(self, labels: dict[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.operator == "exists":
            return present
        if self.operator == "!exists":
            return not present
        if self.operator in ("=", "in"):
            return present and value in self.values
        return not present or value not in self.values  # != and notin


def parse_label_selector(text: str) -> list[Requirement]:
    requirements = []
    for part in re.findall(r"[^,(]+(?:\([^)]*\))?", text or ""):
        part = part.strip()
        if not part:
            continue
        match = re.fullmatch(r"([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)", part)
        if match:
            values = tuple(v.strip() for v in match.group(3).split(",") if v.strip())
            requirements.append(Requirement(match.group(1), match.group(2), values))
        elif "!=" in part:
            key, value = part.split("!=", 1)
            requirements.append(Requirement(key.strip(), "!=", (value.strip(),)))
        elif "=" in part:
            key, value = part.replace("==", "=").split("=", 1)
            requirements.append(Requirement(key.strip(), "=", (value.strip(),)))
        elif part.startswith("!"):
            requirements.append(Requirement(part[1:].strip(), "!exists"))
        else:
            requirements.append(Requirement(part, "exists"))
    return requirements


def parse_field_selector(text: str) -> list[tuple[str, bool, str]]:
    selectors = []
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        if "!=" in part:
            path, value = part.split("!=", 1)
            selectors.append((path.strip(), False, value.strip()))
        else:
            path, value = part.replace("==", "=").split("=", 1)
            selectors.append((path.strip(), True, value.strip()))
    return selectors


def selector_string(selector: dict[str, Any] | None) -> str:
    """A LabelSelector object as the string form /scale reports."""
    if not selector:
        return ""
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expression in selector.get("matchExpressions") or []:
        operator = expression["operator"]
        if operator == "Exists":
            parts.append(expression["key"])
        elif operator == "DoesNotExist":
            parts.append(f"!{expression['key']}")
        else:
            values = ",".join(expression.get("values", []))
            parts.append(f"{expression['key']} {operator.lower()} ({values})")
    return ",".join(parts)


@dataclass(frozen=True)
class Selection:
    namespace: str | None
    labels: list[Requirement]
    fields: list[tuple[str, bool, str]]

    def matches(self, obj: dict[str, Any] | None) -> bool:
        if obj is None:
            return False
        metadata = obj.get("metadata", {})
        if self.namespace is not None and metadata.get("namespace") != self.namespace:
            return False
        labels = metadata.get("labels") or {}
        if not all(requirement.matches(labels) for requirement in self.labels):
            return False
        for path, equal, value in self.fields:
            actual = get_path(obj, "." + path)
            actual_text = "" if actual is None else str(actual)
            if (actual_text == value) != equal:
                return False
        return True
