"""Errors as the OpenAI API reports them: a status, ``{"error": {...}}`` and headers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fastapi.responses import JSONResponse

from pagedllm.api.protocol import error_body


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.code, self.param)


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def unavailable(message: str, code: str | None, retry_after_s: int = 1) -> ApiError:
    """A 503 that tells the client when to retry."""
    return ApiError(
        503,
        message,
        "service_unavailable_error",
        code,
        headers={"Retry-After": str(retry_after_s)},
    )


def invalid_request(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    """A 400 naming what failed validation (pydantic's errors, FastAPI's ``body`` dropped
    from their locations), the first field as ``param``."""
    parts, param = [], None
    for item in errors[:5]:
        loc = [str(p) for p in item.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        param = param or (loc[0] if loc else None)
        parts.append(f"{where}: {item.get('msg')}" if where else str(item.get("msg")))
    return ApiError(400, "invalid request: " + "; ".join(parts), param=param)
