"""The scheduler's side of the block map (``GET /kv``): the pool's whole map, sent only to the
API servers that show it, at most every ``KV_MAP_INTERVAL_S``.

An API server with viewers renews its watch (``WatchKVMap``) while they stay; a watch not
renewed within ``WATCH_LEASE_S`` lapses, so a server that dies or loses its viewers stops the
maps without saying so. With no watch, ``publish`` returns at its first test: the step loop pays
nothing for the page when nobody looks at it.
"""

from __future__ import annotations

import time

import zmq

from pagedllm.core.kv_map import take_map
from pagedllm.core.reporting import SchedulerStats
from pagedllm.core.scheduler import Scheduler
from pagedllm.ipc import messages
from pagedllm.ipc.messages import KV_MAP_INTERVAL_S, WATCH_LEASE_S


class KVMapSender:
    def __init__(self, scheduler: Scheduler, api_servers: list[zmq.Socket]) -> None:
        self.scheduler = scheduler
        self.api_servers = api_servers
        self._leases: dict[int, float] = {}  # API server index -> when its watch lapses
        self._sent_at = 0.0

    def watch(self, client_index: int) -> bool:
        """Renew API server ``client_index``'s watch; False for an index no server has."""
        if not 0 <= client_index < len(self.api_servers):
            return False
        self._leases[client_index] = time.monotonic() + WATCH_LEASE_S
        return True

    def publish(self, stats: SchedulerStats) -> None:
        """Send the map to the watching API servers, unless one went out lately."""
        if not self._leases:
            return
        now = time.monotonic()
        if now - self._sent_at < KV_MAP_INTERVAL_S:
            return
        self._leases = {i: until for i, until in self._leases.items() if until > now}
        if not self._leases:
            return
        s = self.scheduler
        data = messages.encode(
            take_map(s.block_manager, s.running, stats.num_running, stats.num_waiting)
        )
        for index in self._leases:
            self.api_servers[index].send(data, copy=False)
        self._sent_at = now
