"""The two forwarded routes, ``POST /v1/completions`` and ``/v1/chat/completions``, served
straight from ASGI rather than through FastAPI.

Every request the fleet serves passes here, and FastAPI's layers (its middlewares, routing,
dependency solving, the wrapping of every message sent) were a third of the router's CPU time
per request and most of what it added to a first token beyond the HTTP hop itself. The checks
are the same as a node's: the guards (body limit, API key) wrap this app, the body is
validated by the same request models, and every error leaves in OpenAI's shape.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import ValidationError
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.api.errors import ApiError, error_response, invalid_request
from pagedllm.api.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.router.prompts import routing_prompt
from pagedllm.router.proxy import UpstreamResponse
from pagedllm.router.state import RouterState

log = logging.getLogger(__name__)

FORWARDED: dict[str, type[CompletionRequest] | type[ChatCompletionRequest]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}


class ClientGone(Exception):
    """The client disconnected before its body arrived whole."""


@dataclass
class ForwardingFront:
    """The forwarded routes; every other request goes to ``rest`` (the FastAPI app)."""

    state: RouterState
    rest: ASGIApp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        model = FORWARDED.get(scope["path"]) if scope["type"] == "http" else None
        if model is None:
            await self.rest(scope, receive, send)
            return
        if scope["method"] != "POST":
            response: Response = error_response(
                ApiError(405, "Method Not Allowed", headers={"Allow": "POST"})
            )
        else:
            try:
                response = await self._route(scope, receive, model)
            except ClientGone:
                return
            except ApiError as error:
                response = error_response(error)
            except Exception as error:  # noqa: BLE001 - answered as FastAPI's routes answer
                log.exception("unexpected error")
                response = error_response(ApiError(500, f"internal error: {error}", "server_error"))
        await response(scope, receive, send)

    async def _route(
        self,
        scope: Scope,
        receive: Receive,
        model: type[CompletionRequest] | type[ChatCompletionRequest],
    ) -> Response:
        """Tokenize, choose, forward the body as it came (the node parses it again: its
        answer is the same as without the router)."""
        state = self.state
        arrived = time.perf_counter()
        state.in_flight += 1
        try:
            raw = await _body(receive)
            body = _parse(raw, model)
            prompt = await routing_prompt(state.ctx, body)
            backends = await state.router.ready_backends()
            tokens = prompt.head
            if prompt.rest is not None and state.router.holds_all(tokens, backends):
                tokens = await prompt.whole(state.ctx)
            choice = state.router.choose(tokens, backends)
            sent = _once(
                lambda: state.metrics.routing_seconds.observe(time.perf_counter() - arrived)
            )
            content_type = _header(scope, b"content-type") or "application/json"
            response = await state.forwarder.forward(
                scope["path"], content_type, raw, receive, choice.order, choice.key, sent
            )
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


async def _body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _parse(
    raw: bytes, model: type[CompletionRequest] | type[ChatCompletionRequest]
) -> CompletionRequest | ChatCompletionRequest:
    """The body as the request model, validated from Python objects as FastAPI does (JSON
    mode would differ in what it coerces)."""
    try:
        value = json.loads(raw)
    except ValueError as error:
        raise ApiError(400, f"invalid request: the body is not JSON: {error}") from None
    try:
        return model.model_validate(value)
    except ValidationError as error:
        raise invalid_request(error.errors()) from None


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _once(function: Callable[[], None]) -> Callable[[], None]:
    called = False

    def wrapper() -> None:
        nonlocal called
        if not called:
            called = True
            function()

    return wrapper
