"""API errors, answered as a `Status` object with the HTTP code of the error."""

from __future__ import annotations

from typing import Any

from pagedllm_testing.emulator.resources import ResourceType


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: dict | None = None):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details or {}

    def as_status(self) -> dict[str, Any]:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "details": self.details,
            "code": self.code,
        }


def _details(rtype: ResourceType, name: str | None) -> dict[str, Any]:
    return {"name": name or "", "group": rtype.group, "kind": rtype.plural}


def not_found(rtype: ResourceType, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{rtype.qualified} "{name}" not found', _details(rtype, name))


def already_exists(rtype: ResourceType, name: str) -> ApiError:
    return ApiError(
        409, "AlreadyExists", f'{rtype.qualified} "{name}" already exists', _details(rtype, name)
    )


def conflict(rtype: ResourceType, name: str) -> ApiError:
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {rtype.qualified} "{name}": the object has been '
        "modified; please apply your changes to the latest version and try again",
        _details(rtype, name),
    )


def invalid(rtype: ResourceType, name: str, causes: list[tuple[str, str]]) -> ApiError:
    text = ", ".join(f"{path}: {message}" for path, message in causes)
    details = _details(rtype, name)
    details["kind"] = rtype.kind
    details["causes"] = [
        {"reason": "FieldValueInvalid", "message": message, "field": path}
        for path, message in causes
    ]
    return ApiError(
        422, "Invalid", f'{rtype.kind}.{rtype.group or "core"} "{name}" is invalid: {text}', details
    )


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def no_such_resource() -> ApiError:
    """A path that names no resource the server serves."""
    return ApiError(404, "NotFound", "the server could not find the requested resource")
