"""The router's HTTP app: a node's endpoints, error shapes, API key and body limit (the API
server's own pieces); completions and chat are forwarded by ``front``, to the backend the
policy picks, everything else is answered here by FastAPI.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp

from pagedllm.api.app import (
    add_error_handlers,
    add_tokenize_routes,
    add_version_route,
    guarded,
    model_list,
)
from pagedllm.api.protocol import error_body
from pagedllm.router.front import ForwardingFront
from pagedllm.router.state import RouterState
from pagedllm.version import __version__

# How long /v1/models waits for a backend's own list before answering from the flags.
MODELS_TIMEOUT_S = 2.0


def build_router_app(state: RouterState, api_key: str | None) -> ASGIApp:
    app = FastAPI(title="PagedLLM router", version=__version__)
    add_error_handlers(app)
    _add_probes(app, state)
    add_version_route(app)
    _add_routes(app, state)
    add_tokenize_routes(app, state.ctx)
    return guarded(ForwardingFront(state, app), api_key)


def _add_probes(app: FastAPI, state: RouterState) -> None:
    """Never dependent on the backends: a router with none ready still answers (503s with
    Retry-After, or holds requests), and restarting it would not bring one."""

    @app.get("/health")
    async def health() -> Response:
        if not state.draining:
            return Response(status_code=200)
        return JSONResponse(
            error_body("the router is shutting down", "service_unavailable_error", "draining"),
            status_code=503,
            headers={"Retry-After": "1"},
        )

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _add_routes(app: FastAPI, state: RouterState) -> None:
    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        return await _backend_models(state, request) or model_list(state.ctx)


async def _backend_models(state: RouterState, request: Request) -> dict[str, Any] | None:
    """The ready backends' own ``/v1/models``, which name what the nodes really serve, merged:
    each model once, the first node's entry, so that a LoRA adapter served by some nodes only
    is listed too."""
    lists = await asyncio.gather(*(_models_of(state, b.url) for b in state.router.fleet.ready()))
    answered = [value for value in lists if value is not None]
    return merge_model_lists(answered) if answered else None


async def _models_of(state: RouterState, url: str) -> dict[str, Any] | None:
    try:
        async with state.forwarder.client.get(
            url + "/v1/models",
            headers=state.forwarder.auth_headers(),
            timeout=aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S),
        ) as answer:
            if answer.status != 200:
                return None
            value = json.loads(await answer.read())
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None
    if isinstance(value, dict) and isinstance(value.get("data"), list):
        return value
    return None


def merge_model_lists(lists: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``/v1/models`` answer of several nodes' answers: every model (by ``id``) once, as
    the first list naming it has it, in the order first seen."""
    merged: dict[str, Any] = {}
    for value in lists:
        for entry in value["data"]:
            if isinstance(entry, dict) and isinstance(entry.get("id"), str):
                merged.setdefault(entry["id"], entry)
    return {**lists[0], "data": list(merged.values())}
