"""The scheduler's side of the KV-events feed: the prefix cache's changes, the load and the LoRA
adapters (those requests may name, and which the scheduler's LRU holds loaded), sent to every
API server.

After each step the changes the block pool recorded go out in one ``KVEvents`` with the load,
when there are any or the request counts moved; when nothing moves, a load-only ``KVEvents``
goes out at least every ``HEARTBEAT_S``, so an API server's feed carries a fresh load and its
subscribers know the node lives. Every API server gets everything, from the start, so each
keeps the same copy of the hash map (ZeroMQ queues what is sent before an API server binds).
"""

from __future__ import annotations

import time

import zmq

from pagedllm.core.block_pool import BlockPool
from pagedllm.core.kv_events import AdapterState, NodeLoad, adapter_states, group_updates
from pagedllm.core.reporting import SchedulerStats
from pagedllm.ipc import messages
from pagedllm.ipc.messages import CacheLayout, KVEvents

# Longest silence towards the API servers; the feed promises a line at least once a second.
HEARTBEAT_S = 0.5


class KVEventSender:
    def __init__(self, pool: BlockPool, api_servers: list[zmq.Socket], layout: CacheLayout):
        self.pool = pool
        self.api_servers = api_servers
        pool.record_events()
        self._send(messages.encode(layout))
        self._counts: tuple[int, int] | None = None
        # The adapters last sent: the API servers start knowing none.
        self._adapters: list[AdapterState] = []
        self._sent_at = time.monotonic()

    def publish(self, stats: SchedulerStats, served: dict[str, str]) -> None:
        """Send what changed since the last call, if anything did or a heartbeat is due.
        ``served``: the adapters requests may name (name -> directory)."""
        events = self.pool.take_events()
        counts = (stats.num_running, stats.num_waiting)
        adapters = adapter_states(served, stats.loaded_adapters)
        changed = adapters != self._adapters
        now = time.monotonic()
        if (
            not events
            and not changed
            and counts == self._counts
            and now - self._sent_at < HEARTBEAT_S
        ):
            return
        load = NodeLoad(stats.num_running, stats.num_waiting, stats.kv_usage)
        message = KVEvents(group_updates(events), load, adapters if changed else None)
        self._send(messages.encode(message))
        self._counts = counts
        self._adapters = adapters
        self._sent_at = now

    def _send(self, data: bytes) -> None:
        for sock in self.api_servers:
            sock.send(data, copy=False)
