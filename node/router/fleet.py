"""The nodes the router may send to, each with what its feed last said: the blocks it holds,
its load, and the router's own requests in flight to it.

A backend source (the static ``--backends`` list, or Kubernetes discovery) calls
``set_backends`` with the full set whenever it changes: new nodes are subscribed to, nodes that
left are unsubscribed and forgotten (requests in flight to them finish on their own).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from pagedllm.router.feed_messages import Adapter, Load
from pagedllm.router.residency import Residency

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Backend:
    url: str
    # None until the feed's snapshot arrives, and again whenever the feed is lost.
    residency: Residency | None = None
    feed_load: Load | None = None
    # The LoRA adapters the node serves, by name, as its feed last listed them.
    adapters: dict[str, Adapter] = field(default_factory=dict)
    # This router's requests in flight there by their prompt's placement key (the policy's
    # per-prompt load bound); their sum is ``in_flight``.
    prompts: Counter[bytes] = field(default_factory=Counter, repr=False)
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def ready(self) -> bool:
        return self.residency is not None

    def enter(self, key: bytes) -> None:
        """A request with placement key ``key`` left for this backend."""
        self.prompts[key] += 1

    def leave(self, key: bytes) -> None:
        self.prompts[key] -= 1
        if self.prompts[key] <= 0:
            del self.prompts[key]

    @property
    def in_flight(self) -> int:
        """This router's requests at the node, not yet seen to finish."""
        return self.prompts.total()

    @property
    def load(self) -> int:
        """Requests at the node: the feed's running and waiting (which counts other routers'
        too) but never fewer than this router has sent and not seen finish (the feed lags)."""
        reported = 0 if self.feed_load is None else self.feed_load.running + self.feed_load.waiting
        return max(self.in_flight, reported)


Subscriber = Callable[[Backend, "Fleet"], Awaitable[None]]


class Fleet:
    """The router's set of backends; ``subscribe`` follows one backend's feed until cancelled."""

    def __init__(self, subscribe: Subscriber) -> None:
        self._subscribe = subscribe
        self.backends: dict[str, Backend] = {}
        self._ready_changed = asyncio.Condition()
        # Called with a backend's URL and True when it joins, False when it leaves (the
        # metrics create and drop its series).
        self.membership_listeners: list[Callable[[str, bool], None]] = []

    def set_backends(self, urls: Iterable[str]) -> None:
        wanted = list(dict.fromkeys(u.rstrip("/") for u in urls))
        for url in [u for u in self.backends if u not in wanted]:
            backend = self.backends.pop(url)
            if backend.task is not None:
                backend.task.cancel()
            for listener in self.membership_listeners:
                listener(url, False)
            log.info("backend %s removed", url)
        for url in wanted:
            if url not in self.backends:
                backend = self.backends[url] = Backend(url)
                backend.task = asyncio.get_running_loop().create_task(
                    self._subscribe(backend, self), name=f"feed {url}"
                )
                for listener in self.membership_listeners:
                    listener(url, True)
                log.info("backend %s added", url)

    def ready(self) -> list[Backend]:
        return [b for b in self.backends.values() if b.ready]

    def notify(self) -> None:
        """A backend became ready: wake the requests held for one."""

        async def wake() -> None:
            async with self._ready_changed:
                self._ready_changed.notify_all()

        asyncio.get_running_loop().create_task(wake())

    async def wait_ready(self, timeout: float) -> list[Backend]:
        """The ready backends, waiting up to ``timeout`` seconds for one (empty if none came)."""

        async def until_ready() -> None:
            async with self._ready_changed:
                await self._ready_changed.wait_for(lambda: bool(self.ready()))

        try:
            await asyncio.wait_for(until_ready(), timeout)
        except asyncio.TimeoutError:
            pass
        return self.ready()

    async def close(self) -> None:
        tasks = [b.task for b in self.backends.values() if b.task is not None]
        self.backends.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
