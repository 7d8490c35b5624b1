"""The HTTP front: OpenAI-compatible routes, health, metrics, tokenization.

Every error leaves in OpenAI's shape (``{"error": {...}}``) with its status: 400 for invalid
input, 401 for a missing or wrong API key, 404 for an unknown model or route, 413 for an
oversized body, 503 (with Retry-After) while the node is starting, draining, failed or full.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.api import kv_page
from pagedllm.api.engine_client import NodeState
from pagedllm.api.errors import ApiError, error_response, invalid_request, unavailable
from pagedllm.api.event_stream import (
    EventStreamResponse,
    JsonLinesResponse,
    unless_disconnected,
)
from pagedllm.api.generation import GenerationError
from pagedllm.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    UnloadLoRAAdapterRequest,
    error_body,
)
from pagedllm.api.serving import GenerationRun, ServingContext, from_generation_error
from pagedllm.api.serving_chat import prepare_chat
from pagedllm.api.serving_completions import prepare_completion
from pagedllm.api.tokenizing import TokenizingContext
from pagedllm.runtime import metrics
from pagedllm.version import __version__

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20
# Token ids written to JSON per slice (see _tokenize_json).
JSON_SLICE = 16384
# Probes and scrapers must reach these without the API key.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})
ERROR_KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable_error",
}


class ApiKeyMiddleware:
    """Checks ``Authorization: Bearer <key>`` before the body is read (on the block map's
    page, its files and feed, the key's cookie too: see ``kv_page``)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"")
            page = kv_page.on_page(scope["path"])
            if page and kv_page.cookie_matches(headers.get(b"cookie", b""), self.api_key):
                given = self.expected
            if not hmac.compare_digest(given, self.expected):
                if scope["path"] == kv_page.PAGE_PATH:
                    await kv_page.login_page()(scope, receive, send)
                    return
                response = error_response(
                    ApiError(
                        401,
                        "missing or wrong API key: send Authorization: Bearer <key>",
                        "authentication_error",
                        "invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"},
                    )
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyTooLarge(HTTPException):
    """A body that grew past the limit while being read: an HTTPException, as FastAPI turns any
    other exception raised while it reads a body into a 400."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.status, error.message)
        self.error = error


class BodyLimitMiddleware:
    """413 for a body over ``limit`` bytes: at once from Content-Length, or as soon as a
    chunked body grows past it."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await error_response(self._too_large())(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise BodyTooLarge(self._too_large())
            return message

        await self.app(scope, counting_receive, send)

    def _too_large(self) -> ApiError:
        return ApiError(
            413, f"the request body exceeds {self.limit} bytes", code="request_too_large"
        )


def build_app(ctx: ServingContext, api_key: str | None) -> ASGIApp:
    app = FastAPI(title="PagedLLM", version=__version__)
    add_error_handlers(app)
    _add_probes(app, ctx)
    _add_openai_routes(app, ctx)
    if ctx.runtime_lora_updates:
        _add_lora_routes(app, ctx)
    add_tokenize_routes(app, ctx)
    kv_page.add_kv_page_routes(app, ctx)
    return guarded(app, api_key)


def guarded(app: ASGIApp, api_key: str | None) -> ASGIApp:
    """``app`` behind the body size limit and, when there is one, the API key (checked first:
    no body is read for a caller without it)."""
    app = BodyLimitMiddleware(app, limit=MAX_BODY_BYTES)
    return ApiKeyMiddleware(app, api_key=api_key) if api_key else app


def add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape, whatever raised it."""

    @app.exception_handler(ApiError)
    async def api_error(_: Request, error: ApiError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(BodyTooLarge)
    async def too_large(_: Request, error: BodyTooLarge) -> JSONResponse:
        return error_response(error.error)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(invalid_request(error.errors()))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        kind = ERROR_KINDS.get(error.status_code, "invalid_request_error")
        body = error_body(str(error.detail), kind)
        return JSONResponse(body, status_code=error.status_code, headers=error.headers)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, error: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return JSONResponse(error_body(f"internal error: {error}", "server_error"), status_code=500)


def _add_probes(app: FastAPI, ctx: ServingContext) -> None:
    """What Kubernetes and Prometheus read: no API key needed (see OPEN_PATHS)."""

    @app.get("/health")
    async def health() -> Response:
        state = ctx.client.state
        if state == NodeState.READY:
            return Response(status_code=200)
        reason = ctx.client.failure if state == NodeState.FAILED else None
        message = f"the server is {state.value}" + (f": {reason}" if reason else "")
        return JSONResponse(
            error_body(message, "service_unavailable_error", state.value),
            status_code=503,
            headers={"Retry-After": "1"},
        )

    add_version_route(app)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


def add_version_route(app: FastAPI) -> None:
    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}


def model_list(ctx: TokenizingContext) -> dict[str, Any]:
    """The answer of ``GET /v1/models``."""
    created = int(time.time())
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "pagedllm",
                "root": ctx.model_dir,
                "parent": None,
                "max_model_len": ctx.max_model_len,
            }
            for name in ctx.model_names
        ]
        + [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "pagedllm",
                "root": adapter.lora_path,
                "parent": ctx.model_name,
                "max_model_len": ctx.max_model_len,
            }
            for name, adapter in ctx.adapters.items()
        ],
    }


def _add_openai_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return model_list(ctx)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _generate(await prepare_completion(ctx, body), body.stream, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _generate(await prepare_chat(ctx, body), body.stream, request)

    @app.get("/v1/kv_events")
    async def kv_events() -> Response:
        # What the prefix cache holds, then its changes: for routers (see api.kv_events).
        ctx.check_admitting()
        feed = ctx.client.kv_events
        if not feed.ready:  # the scheduler's layout is on its way
            raise unavailable("the server is starting; retry the request", "starting")
        snapshot, subscriber = feed.subscribe()
        return JsonLinesResponse(
            feed.stream(snapshot, subscriber), lambda: feed.unsubscribe(subscriber)
        )


def _add_lora_routes(app: FastAPI, ctx: ServingContext) -> None:
    """vLLM's runtime adapter endpoints (behind --allow-runtime-lora-updating and the API key):
    the scheduler checks the adapter and tells every API server the new list."""

    async def update(name: str, path: str | None) -> Response:
        ctx.check_admitting()
        answer = await ctx.client.update_adapter(name, path)
        if answer.status != 200:
            kind = "not_found_error" if answer.status == 404 else "invalid_request_error"
            raise ApiError(answer.status, answer.message, kind, param="lora_name")
        return PlainTextResponse(answer.message)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        return await update(body.lora_name, body.lora_path)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        return await update(body.lora_name, None)


def add_tokenize_routes(app: FastAPI, ctx: TokenizingContext) -> None:
    """``/tokenize`` and ``/detokenize``: the tokenizer alone, no engine."""

    # Any length is tokenized here (no bound), off the event loop, and so is the answer's JSON:
    # a long prompt's token list takes a while to serialize.
    @app.post("/tokenize")
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> Response:
        ctx.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            text = await ctx.render_request(body)
            tokens = await ctx.chat_tokens(text)
        else:
            tokens = await ctx.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        head = {"count": len(tokens), "max_model_len": ctx.max_model_len}
        body = await ctx.in_thread(len(tokens), _tokenize_json, head, tokens)
        return Response(body, media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        ctx.check_token_ids(body.tokens, "tokens")
        return {"prompt": await ctx.in_thread(len(body.tokens), ctx.tokenizer.decode, body.tokens)}


def _tokenize_json(head: dict[str, int], tokens: list[int]) -> bytes:
    """``head`` with ``"tokens": tokens``, written a slice at a time: each slice holds the GIL
    only briefly, so the event loop keeps answering while a long list is written."""
    slices = [
        ",".join(map(str, tokens[i : i + JSON_SLICE])) for i in range(0, len(tokens), JSON_SLICE)
    ]
    return (json.dumps(head)[:-1] + ', "tokens": [' + ",".join(slices) + "]}").encode()


async def _generate(run: GenerationRun, stream: bool, request: Request) -> Response:
    """Start the generation; answer with the whole result, or stream it once the first step
    is in (so that a rejection still gets its own status instead of a broken stream)."""
    generation = run.generation
    generation.start()
    handed_over = False
    try:
        if stream:
            first = await unless_disconnected(generation.next(), request.receive)
            if first is None:
                return Response(status_code=499)  # the client left; nobody reads this
            handed_over = True
            return EventStreamResponse(run.stream(first), generation.close)
        await unless_disconnected(generation.run_to_end(), request.receive)
        if not generation.done:
            return Response(status_code=499)  # the client left; nobody reads this
        return JSONResponse(run.response())
    except GenerationError as error:
        return error_response(from_generation_error(error))
    finally:
        if not handed_over:
            generation.close()
