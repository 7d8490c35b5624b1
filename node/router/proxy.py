"""Forwarding one request: the original body to the chosen backend, its answer streamed back
as it comes (SSE included, never buffered whole).

A backend that refuses the connection or answers 503 before anything was sent to the client
is skipped for the next in the policy's order; once the answer started, the client gets it as
it is. A client that goes away closes the upstream connection, which aborts the request at the
node and frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pagedllm.api.errors import ApiError, error_response, unavailable
from pagedllm.router.fleet import Fleet
from pagedllm.router.metrics import RouterMetrics

log = logging.getLogger(__name__)

# What is passed back from the backend's answer (the body is streamed, so no Content-Length).
RELAYED_HEADERS = ("content-type", "retry-after", "cache-control", "x-accel-buffering")


class UpstreamResponse(Response):
    """Relays a backend's streaming answer; closes it (and so aborts the request upstream)
    however the relay ends, and then calls ``on_close``."""

    def __init__(self, upstream: aiohttp.ClientResponse, on_close: Callable[[], None]) -> None:
        super().__init__(status_code=upstream.status)
        self.raw_headers = [
            (k.lower().encode(), v.encode())
            for k, v in upstream.headers.items()
            if k.lower() in RELAYED_HEADERS
        ]
        self.upstream = upstream
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # A client that leaves cancels the task serving it (``front.Departure``), which ends
        # the relay wherever it waits.
        try:
            await self._relay(send)
        except (OSError, aiohttp.ClientError) as error:
            # The client went away mid-write, or the backend mid-answer: the answer stays cut.
            log.info("relay from %s ended early: %s", self.upstream.url, error)
        finally:
            self.on_close()
            # Read to its end, the connection goes back to the pool; cut short, closing it
            # is what aborts the request at the node.
            if self.upstream.content.at_eof():
                self.upstream.release()
            else:
                self.upstream.close()

    async def _relay(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        # Whatever has arrived, as it arrives: an SSE event is never held back for the next.
        async for chunk in self.upstream.content.iter_any():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


@dataclass
class Forwarder:
    client: aiohttp.ClientSession
    fleet: Fleet
    metrics: RouterMetrics
    api_key: str | None

    def auth_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def forward(
        self,
        path: str,
        content_type: str,
        body: bytes,
        order: list[str],
        key: bytes,
        on_sent: Callable[[], None],
    ) -> Response:
        """The first answer of the backends in ``order`` that neither refuses the connection
        nor answers 503; ``key`` is the prompt's placement key, counted in flight where the
        request goes; ``on_sent`` is called when the request first leaves for a backend."""
        headers = {"content-type": content_type, **self.auth_headers()}
        refusals: list[str] = []
        last_503: dict[str, Any] | None = None
        for url in order:
            backend = self.fleet.backends.get(url)
            if backend is None:  # removed since the choice
                continue
            backend.enter(key)
            handed_over = False
            try:
                on_sent()
                upstream = await self.client.post(url + path, data=body, headers=headers)
                if upstream.status == 503:
                    last_503 = await _read_error(upstream)
                    self.metrics.upstream_errors.labels(url, "unavailable").inc()
                    refusals.append(f"{url} answered 503")
                    continue
                handed_over = True

                def done(backend: Any = backend) -> None:
                    backend.leave(key)

                return UpstreamResponse(upstream, done)
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as error:
                self.metrics.upstream_errors.labels(url, "connect").inc()
                refusals.append(f"{url}: {error or type(error).__name__}")
            except (aiohttp.ClientError, asyncio.TimeoutError) as error:
                # It may have reached the node: not retried, so it never runs twice.
                self.metrics.upstream_errors.labels(url, "broken").inc()
                return error_response(
                    ApiError(
                        502,
                        f"the serving node {url} failed before answering: "
                        f"{error or type(error).__name__}",
                        "server_error",
                        "upstream_failed",
                    )
                )
            finally:
                if not handed_over:
                    backend.leave(key)
        message = _error_message(last_503)
        if message is not None:
            error = unavailable(message, "upstream_unavailable")
        else:
            error = unavailable(
                "no serving node accepted the request (" + "; ".join(refusals) + ")",
                "no_backend",
            )
        return error_response(error)


def _error_message(body: dict[str, Any] | None) -> str | None:
    """The message of an OpenAI-shaped error body, if it is one."""
    error = (body or {}).get("error")
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) else None


async def _read_error(upstream: aiohttp.ClientResponse) -> dict[str, Any] | None:
    try:
        value = json.loads(await upstream.read())
        return value if isinstance(value, dict) else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None
    finally:
        upstream.release()
