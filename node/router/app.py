"""The router's HTTP front: a node's endpoints, error shapes, API key and body limit (the
API server's own pieces), with completions and chat forwarded to the backend the policy picks.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from pagedllm import __version__
from pagedllm.api.app import (
    add_error_handlers,
    add_guards,
    add_tokenize_routes,
    add_version_route,
    model_list,
)
from pagedllm.api.protocol import ChatCompletionRequest, CompletionRequest, error_body
from pagedllm.api.tokenizing import TokenizingContext
from pagedllm.router.metrics import RouterMetrics
from pagedllm.router.prompts import routing_tokens
from pagedllm.router.proxy import Forwarder, UpstreamResponse
from pagedllm.router.routing import Router

# How long /v1/models waits for a backend's own list before answering from the flags.
MODELS_TIMEOUT_S = 2.0


@dataclass
class RouterState:
    """What the routes share; ``draining`` turns /health to 503 (set on SIGTERM)."""

    ctx: TokenizingContext
    router: Router
    forwarder: Forwarder
    metrics: RouterMetrics
    draining: bool = False
    in_flight: int = 0


def build_router_app(state: RouterState, api_key: str | None) -> FastAPI:
    app = FastAPI(title="PagedLLM router", version=__version__)
    add_guards(app, api_key)
    add_error_handlers(app)
    _add_probes(app, state)
    add_version_route(app)
    _add_routes(app, state)
    add_tokenize_routes(app, state.ctx)
    return app


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

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _route(state, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _route(state, body, request)


async def _route(
    state: RouterState, body: CompletionRequest | ChatCompletionRequest, request: Request
) -> Response:
    """Tokenize, choose, forward the body as it came (the node parses it again: its answer is
    the same as without the router)."""
    arrived = time.perf_counter()
    state.in_flight += 1
    try:
        raw = await request.body()
        tokens = await routing_tokens(state.ctx, body)
        backends = await state.router.ready_backends()
        choice = state.router.choose(tokens, backends)
        sent = _once(lambda: state.metrics.routing_seconds.observe(time.perf_counter() - arrived))
        response = await state.forwarder.forward(request, raw, choice.order, choice.key, sent)
    except BaseException:
        state.in_flight -= 1
        raise
    if isinstance(response, UpstreamResponse):  # in flight until its last byte is relayed

        def done() -> None:
            state.in_flight -= 1

        response.on_close.append(done)
    else:
        state.in_flight -= 1
    return response


def _once(function: Callable[[], None]) -> Callable[[], None]:
    called = False

    def wrapper() -> None:
        nonlocal called
        if not called:
            called = True
            function()

    return wrapper


async def _backend_models(state: RouterState, request: Request) -> dict[str, Any] | None:
    """A ready backend's own ``/v1/models``, which names what the nodes really serve."""
    for backend in state.router.fleet.ready():
        try:
            async with state.forwarder.client.get(
                backend.url + "/v1/models",
                headers=state.forwarder.auth_headers(),
                timeout=aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S),
            ) as answer:
                if answer.status != 200:
                    continue
                value = json.loads(await answer.read())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            continue
        if isinstance(value, dict) and isinstance(value.get("data"), list):
            return value
    return None
