"""Following one node's ``GET /v1/kv_events``: its snapshot replaces what was known, its updates
are applied in order, and a feed that breaks, skips a line or stays silent for ``SILENCE_S``
(heartbeats come every second) is dropped and reconnected, the node unready meanwhile."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass

import aiohttp

from pagedllm.router.feed_messages import FeedError, Snapshot, Update, hashes, parse_line
from pagedllm.router.fleet import Backend, Fleet
from pagedllm.router.hashing import HashScheme
from pagedllm.router.residency import Residency

log = logging.getLogger(__name__)

FEED_PATH = "/v1/kv_events"
SILENCE_S = 5.0
# Reconnection backoff: from the first to the last, doubling.
RETRY_FIRST_S = 0.2
RETRY_LAST_S = 2.0


@dataclass
class FeedFollower:
    """Subscribes backends to their feeds over one shared HTTP client."""

    client: aiohttp.ClientSession
    headers: dict[str, str]
    silence_s: float = SILENCE_S

    async def __call__(self, backend: Backend, fleet: Fleet) -> None:
        """Follow ``backend``'s feed until cancelled (when the backend leaves the fleet)."""
        delay = RETRY_FIRST_S
        last_error = ""
        while True:
            try:
                await self._follow(backend, fleet)
                error = "the feed ended"
            except (aiohttp.ClientError, asyncio.TimeoutError, FeedError) as exc:
                error = str(exc) or type(exc).__name__
            finally:
                was_ready = backend.ready
                backend.residency = None
                backend.feed_load = None
                backend.adapters = {}
            if was_ready:
                delay = RETRY_FIRST_S
            if error != last_error or was_ready:
                log.warning("backend %s unready: %s", backend.url, error)
                last_error = error
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_LAST_S)

    async def _follow(self, backend: Backend, fleet: Fleet) -> None:
        # sock_read: the longest silence between lines.
        timeout = aiohttp.ClientTimeout(sock_connect=self.silence_s, sock_read=self.silence_s)
        url = backend.url + FEED_PATH
        async with self.client.get(url, headers=self.headers, timeout=timeout) as response:
            if response.status != 200:
                raise FeedError(f"{url} answered HTTP {response.status}")
            expected: int | None = None
            async for line in lines_of(response.content.iter_any()):
                if not line.strip():
                    continue
                was_ready = backend.ready
                expected = apply_line(backend, parse_line(line), expected)
                if not was_ready:
                    log.info("backend %s ready", backend.url)
                    fleet.notify()


async def lines_of(chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """The lines of a stream of ``chunks``, however long: a snapshot line holds every cached
    block, and aiohttp's own line reader refuses lines over twice its read buffer."""
    parts: list[bytes] = []
    async for chunk in chunks:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            parts.append(chunk[start:end])
            yield b"".join(parts)
            parts.clear()
            start = end + 1
        if start < len(chunk):
            parts.append(chunk[start:])
    if parts:
        yield b"".join(parts)


def apply_line(backend: Backend, message: Snapshot | Update, expected: int | None) -> int:
    """Apply one feed line to what is known of ``backend``; the next line's ``seq``.

    A snapshot replaces everything; an update must follow the line before it (``expected``),
    else FeedError: a line was lost, and only a new snapshot can say what the node holds."""
    if isinstance(message, Snapshot):
        scheme = HashScheme(message.block_size, message.hash_seed)
        backend.residency = Residency(scheme, set(hashes(message.blocks)))
        backend.adapters = {a.name: a for a in message.adapters}
    elif backend.residency is None or message.seq != expected:
        raise FeedError(f"{backend.url}: update {message.seq} out of order (expected {expected})")
    else:
        backend.residency.apply([bytes.fromhex(h) for h in message.removed], hashes(message.stored))
        if message.adapters is not None:
            backend.adapters = {a.name: a for a in message.adapters}
    backend.feed_load = message.load
    return message.seq + 1
