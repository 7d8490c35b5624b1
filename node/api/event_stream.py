"""Streamed responses (server-sent events, JSON lines) that stop, and clean up, the moment the
client goes away."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)
T = TypeVar("T")


async def until_disconnect(receive: Receive) -> None:
    """Returns when the client has closed the connection (the request body already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(work: Awaitable[T], receive: Receive) -> T | None:
    """``work``'s result, or None when the client leaves first (``work`` is then cancelled)."""
    work_task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_disconnect(receive))
    try:
        await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work_task.done():
            work_task.cancel()
            # Let it unwind: until then it still runs ``work`` (an event generator, say), which
            # the caller may want to close.
            await asyncio.wait({work_task})
    if work_task.cancelled() or not work_task.done():
        return None
    return work_task.result()


class EventStreamResponse(StreamingResponse):
    """Streams ``events``; calls ``on_close`` once however the stream ends.

    Whether the events run out, the client disconnects (noticed while waiting for the next
    event too, not only when a write fails) or something fails, ``on_close`` runs, so the
    request's engine work is aborted and its blocks freed at once.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(
            events,
            media_type=self.media_type,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await unless_disconnected(self._stream(send), receive)
        except OSError:
            pass  # the client went away mid-write
        finally:
            self.on_close()
            aclose: Any = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _stream(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        async for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class JsonLinesResponse(EventStreamResponse):
    """Streams newline-delimited JSON (one object a line), ending like ``EventStreamResponse``."""

    media_type = "application/x-ndjson"
