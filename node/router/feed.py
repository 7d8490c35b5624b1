"""Following one node's ``GET /v1/kv_events``: its snapshot replaces what was known, its updates
are applied in order, and a feed that breaks, skips a line or stays silent for ``SILENCE_S``
(heartbeats come every second) is dropped and reconnected, the node unready meanwhile."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx

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

    client: httpx.AsyncClient
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
            except (httpx.HTTPError, FeedError) as exc:
                error = str(exc) or type(exc).__name__
            finally:
                was_ready = backend.ready
                backend.residency = None
                backend.feed_load = None
            if was_ready:
                delay = RETRY_FIRST_S
            if error != last_error or was_ready:
                log.warning("backend %s unready: %s", backend.url, error)
                last_error = error
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_LAST_S)

    async def _follow(self, backend: Backend, fleet: Fleet) -> None:
        timeout = httpx.Timeout(self.silence_s)  # read: the longest silence between lines
        url = backend.url + FEED_PATH
        async with self.client.stream(
            "GET", url, headers=self.headers, timeout=timeout
        ) as response:
            if response.status_code != 200:
                raise FeedError(f"{url} answered HTTP {response.status_code}")
            expected: int | None = None
            async for line in response.aiter_lines():
                if not line.strip():
                    continue
                was_ready = backend.ready
                expected = apply_line(backend, parse_line(line), expected)
                if not was_ready:
                    log.info("backend %s ready", backend.url)
                    fleet.notify()


def apply_line(backend: Backend, message: Snapshot | Update, expected: int | None) -> int:
    """Apply one feed line to what is known of ``backend``; the next line's ``seq``.

    A snapshot replaces everything; an update must follow the line before it (``expected``),
    else FeedError: a line was lost, and only a new snapshot can say what the node holds."""
    if isinstance(message, Snapshot):
        scheme = HashScheme(message.block_size, message.hash_seed)
        backend.residency = Residency(scheme, set(hashes(message.blocks)))
    elif backend.residency is None or message.seq != expected:
        raise FeedError(f"{backend.url}: update {message.seq} out of order (expected {expected})")
    else:
        backend.residency.apply([bytes.fromhex(h) for h in message.removed], hashes(message.stored))
    backend.feed_load = message.load
    return message.seq + 1
