"""An API server's copy of the node's prefix-cache hash map, and the subscribers of its feed.

The scheduler sends every API server the same ``KVEvents`` from the start, so each keeps the
whole hash map (hash -> parent, in the order the hashes entered). ``GET /v1/kv_events`` streams
it as newline-delimited JSON: a snapshot first, then one ``update`` line per update applied
after it, ``seq`` counting the updates this copy has applied (the snapshot carries the count
it includes), so two subscribers see the same update under the same number. The snapshot
names the feed's ``version`` and lists the node's LoRA adapters (name, path, loaded); an
update lists them again only when they changed. When the
scheduler is silent (inside a long step, say) a heartbeat update with the last load goes out
at least every second.

Each subscriber has its own bounded queue of lines. One that does not keep up is dropped,
rather than letting the queue grow: its stream ends, and it reconnects to a fresh snapshot.
Every stream ends when the node drains or fails.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

from pagedllm.core.kv_events import (
    FEED_VERSION,
    AdapterState,
    KVUpdate,
    NodeLoad,
    apply_update,
    parents_first,
)
from pagedllm.ipc.messages import CacheLayout, KVEvents

log = logging.getLogger(__name__)

# A subscriber more than this many lines behind is dropped.
MAX_QUEUED_LINES = 1024
# The heartbeat task's period, and the silence after which it sends a line: together at most a
# second between lines.
HEARTBEAT_CHECK_S = 0.25
HEARTBEAT_AFTER_S = 0.7


@dataclass(eq=False)
class Subscription:
    # Lines ready to send; None ends the stream.
    lines: asyncio.Queue[bytes | None] = field(
        default_factory=lambda: asyncio.Queue(MAX_QUEUED_LINES)
    )

    def push(self, line: bytes) -> bool:
        """Queue ``line``; False when the subscriber is too far behind to take it."""
        try:
            self.lines.put_nowait(line)
        except asyncio.QueueFull:
            return False
        return True

    def end(self) -> None:
        """End the stream after what it is sending now: queued lines are dropped."""
        while not self.lines.empty():
            self.lines.get_nowait()
        self.lines.put_nowait(None)


@dataclass
class KVEventFeed:
    layout: CacheLayout | None = None
    blocks: dict[bytes, bytes] = field(default_factory=dict)
    load: NodeLoad = field(default_factory=lambda: NodeLoad(0, 0, 0.0))
    adapters: list[AdapterState] = field(default_factory=list)
    seq: int = 0
    closed: bool = False
    subscribers: set[Subscription] = field(default_factory=set)
    _last_line_at: float = field(default_factory=time.monotonic)

    @property
    def ready(self) -> bool:
        """Whether the scheduler said how it hashes (it does so before any event)."""
        return self.layout is not None and not self.closed

    def set_layout(self, layout: CacheLayout) -> None:
        self.layout = layout

    def apply(self, message: KVEvents) -> None:
        """Apply the scheduler's updates and pass each to the subscribers (a heartbeat when
        there are none)."""
        self.load = message.load
        if message.adapters is not None:
            self.adapters = message.adapters
        for i, update in enumerate(message.updates or [KVUpdate()]):
            apply_update(self.blocks, update)
            # New adapters ride on the first line of the message that brought them.
            self._publish(update, message.adapters if i == 0 else None)

    def heartbeat(self) -> None:
        """An empty update with the last load, unless a line went out lately (or nobody
        listens)."""
        if self.subscribers and time.monotonic() - self._last_line_at >= HEARTBEAT_AFTER_S:
            self._publish(KVUpdate())

    def _publish(self, update: KVUpdate, adapters: list[AdapterState] | None = None) -> None:
        self.seq += 1
        self._last_line_at = time.monotonic()
        if not self.subscribers:
            return
        value: dict[str, Any] = {
            "type": "update",
            "seq": self.seq,
            "stored": [[h.hex(), parent.hex()] for h, parent in update.stored],
            "removed": [h.hex() for h in update.removed],
            "load": asdict(self.load),
        }
        if adapters is not None:
            value["adapters"] = [asdict(a) for a in adapters]
        line = _line(value)
        for subscriber in list(self.subscribers):
            if not subscriber.push(line):
                log.warning(
                    "dropped a KV-events subscriber %d lines behind; it gets a fresh snapshot "
                    "when it reconnects",
                    MAX_QUEUED_LINES,
                )
                self._drop(subscriber)

    def subscribe(self) -> tuple[bytes, Subscription]:
        """The snapshot line and the subscription that continues it, with nothing between."""
        layout = self.layout
        assert layout is not None, "subscribe only once the feed is ready"
        snapshot = _line(
            {
                "type": "snapshot",
                "version": FEED_VERSION,
                "seq": self.seq,
                "block_size": layout.block_size,
                "hash_seed": layout.hash_seed,
                "num_blocks": layout.num_blocks,
                "blocks": [[h.hex(), parent.hex()] for h, parent in parents_first(self.blocks)],
                "load": asdict(self.load),
                "adapters": [asdict(a) for a in self.adapters],
            }
        )
        subscriber = Subscription()
        self.subscribers.add(subscriber)
        return snapshot, subscriber

    def unsubscribe(self, subscriber: Subscription) -> None:
        self.subscribers.discard(subscriber)

    def _drop(self, subscriber: Subscription) -> None:
        self.subscribers.discard(subscriber)
        subscriber.end()

    def close(self) -> None:
        """End every stream: the node drains or failed."""
        self.closed = True
        for subscriber in list(self.subscribers):
            self._drop(subscriber)

    async def run_heartbeats(self) -> None:
        while not self.closed:
            await asyncio.sleep(HEARTBEAT_CHECK_S)
            if self.layout is not None:
                self.heartbeat()

    @staticmethod
    async def stream(snapshot: bytes, subscriber: Subscription) -> AsyncIterator[bytes]:
        """The lines of one subscription, until the feed drops or ends it (whoever streams
        them unsubscribes when the client leaves first)."""
        yield snapshot
        while (line := await subscriber.lines.get()) is not None:
            yield line


def _line(value: dict[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode() + b"\n"
