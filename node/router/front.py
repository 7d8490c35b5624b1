"""The two forwarded routes, ``POST /v1/completions`` and ``/v1/chat/completions``, served
straight from ASGI rather than through FastAPI.

Every request the fleet serves passes here, and FastAPI's layers (its middlewares, routing,
dependency solving, the wrapping of every message sent) took about a fifth of the router's CPU
time per request (py-spy, short prompts against a node that answers at once). The checks are
the same as a node's: the guards (body limit, API key) wrap this app, the body is
validated by the same request models, and every error leaves in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.api.app import BodyTooLarge
from pagedllm.api.errors import ApiError, error_response, invalid_request
from pagedllm.api.event_stream import until_disconnect
from pagedllm.api.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.router.hashing import PromptHashes
from pagedllm.router.prompts import routing_prompt
from pagedllm.router.routing import requested_adapter
from pagedllm.router.state import RouterState

log = logging.getLogger(__name__)

RequestModel = type[CompletionRequest] | type[ChatCompletionRequest]
FORWARDED: dict[str, RequestModel] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}


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
            refusal = ApiError(405, "Method Not Allowed", headers={"Allow": "POST"})
            await error_response(refusal)(scope, receive, send)
            return
        self.state.in_flight += 1  # until the answer's last byte is relayed
        try:
            await self._serve(scope, receive, send, model)
        finally:
            self.state.in_flight -= 1

    async def _serve(self, scope: Scope, receive: Receive, send: Send, model: RequestModel) -> None:
        arrived = time.perf_counter()
        request = Request(scope, receive)
        try:
            raw = await request.body()
        except ClientDisconnect:
            return
        except BodyTooLarge as error:
            await error_response(error.error)(scope, receive, send)
            return
        departure = Departure(receive)
        try:
            response = await self._forward(request, raw, model, arrived)
            await response(scope, receive, send)
        except asyncio.CancelledError:
            if not departure.left:
                raise
            # The client left: the backend's answer, if any, was closed (which aborts the
            # request there) and nobody reads an answer from here.
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
        finally:
            departure.close()

    async def _forward(
        self, request: Request, raw: bytes, model: RequestModel, arrived: float
    ) -> Response:
        """Parse, tokenize, choose, forward the body as it came (the node parses it again: its
        answer is the same as without the router); errors before the backend's answer as a
        node's."""
        state = self.state
        try:
            body = _parse(raw, model)
            prompt = await routing_prompt(state.ctx, body)
            backends = await state.router.ready_backends()
            adapter = requested_adapter(body.model, backends)
            hashes = PromptHashes(prompt.head)
            if prompt.rest is not None and state.router.holds_all(hashes, backends, adapter):
                hashes = PromptHashes(await prompt.whole(state.ctx))
            choice = state.router.choose(hashes, backends, adapter)
            sent = _once(
                lambda: state.metrics.routing_seconds.observe(time.perf_counter() - arrived)
            )
            content_type = request.headers.get("content-type", "application/json")
            return await state.forwarder.forward(
                request.url.path, content_type, raw, choice.order, choice.key, sent
            )
        except ApiError as error:
            return error_response(error)
        except Exception as error:  # noqa: BLE001 - answered as FastAPI's routes answer
            log.exception("unexpected error")
            return error_response(ApiError(500, f"internal error: {error}", "server_error"))


class Departure:
    """Cancels the task serving a request when its client disconnects: one watcher for the
    whole request, the wait for the backend and the relay of its answer alike (a watcher for
    each cost every first token two more tasks)."""

    def __init__(self, receive: Receive) -> None:
        self.left = False
        self._serving = asyncio.current_task()
        self._watch = asyncio.ensure_future(until_disconnect(receive))
        self._watch.add_done_callback(self._on_disconnect)

    def _on_disconnect(self, watch: asyncio.Future[None]) -> None:
        if not watch.cancelled() and watch.exception() is None and self._serving is not None:
            self.left = True
            self._serving.cancel()

    def close(self) -> None:
        self._watch.remove_done_callback(self._on_disconnect)
        self._watch.cancel()


def _parse(raw: bytes, model: RequestModel) -> CompletionRequest | ChatCompletionRequest:
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


def _once(function: Callable[[], None]) -> Callable[[], None]:
    called = False

    def wrapper() -> None:
        nonlocal called
        if not called:
            called = True
            function()

    return wrapper
