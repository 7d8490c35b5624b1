"""An API server's line to the scheduler and the supervisor.

Requests go out on a PUSH socket; one task reads the server's inbox and routes each message
to the queue of the HTTP request it belongs to. The inbox also carries the prefix cache's
events, which keep the KV-events feed (``kv_events``), the block maps of ``GET /kv``
(``kv_map``), and the supervisor's orders, which set
the node state that ``/health`` reports.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from pagedllm.api.kv_events import KVEventFeed
from pagedllm.api.kv_map import KVMapView
from pagedllm.core.kv_map import KVMap
from pagedllm.core.lora_request import LoRARequest
from pagedllm.ipc import sockets
from pagedllm.ipc.messages import (
    AbortRequest,
    AddRequest,
    ApiServerIdle,
    CacheLayout,
    Drain,
    DrainDeadline,
    KVEvents,
    LoadLoRAAdapter,
    LoRAAdapters,
    LoRAAdapterUpdated,
    NodeFailed,
    NodeReady,
    ProcessReady,
    RequestOutputs,
    RequestRejected,
    StopSequence,
    UnloadLoRAAdapter,
    WatchKVMap,
)
from pagedllm.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class NodeState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


# Takes each message the scheduler (or the supervisor) sends about one engine request.
Deliver = Callable[[Any], None]


class EngineClient:
    def __init__(self, paths: sockets.IpcPaths, index: int) -> None:
        self.index = index
        self.state = NodeState.STARTING
        self.failure: str | None = None
        self.in_flight = 0
        # Set once --shutdown-timeout has passed: a request that comes to the engine after it
        # ends at once, like those in flight did.
        self._deadline: DrainDeadline | None = None
        self._subscriptions: dict[str, Deliver] = {}
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self._requests = sockets.push(self._sync_ctx, paths.requests)
        self._control = sockets.push(self._sync_ctx, paths.control)
        self._inbox = sockets.pull(self._async_ctx, paths.api(index))
        self.kv_events = KVEventFeed()
        self.kv_map = KVMapView(lambda: sockets.send(self._requests, WatchKVMap(self.index)))
        self._tasks: list[asyncio.Task[None]] = []
        # Told the adapters' name -> directory whenever the scheduler's list changes.
        self.on_adapters: Callable[[dict[str, str]], None] | None = None
        self._update_ids = itertools.count()

    def start(self) -> None:
        """Start reading the inbox and the feed's heartbeats (from inside the event loop)."""
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._receive()),
            loop.create_task(self.kv_events.run_heartbeats()),
            loop.create_task(self.kv_map.renew_watch()),
        ]
        for task in self._tasks:
            task.add_done_callback(_exit_if_failed)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._async_ctx.destroy(linger=0)
        self._sync_ctx.destroy(linger=0)

    def report_ready(self) -> None:
        sockets.send(self._control, ProcessReady("api_server", self.index))

    # ----- requests ------------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        deliver: Deliver,
        final_only: bool = False,
        first_of_request: bool = True,
        lora: LoRARequest | None = None,
    ) -> float:
        """Send a request whose messages go to ``deliver``; returns its arrival time. With
        ``final_only`` its steps between the first token and the end come merged; a request
        not ``first_of_request`` is another prompt of the HTTP request sent just before."""
        arrival = time.monotonic()
        if self._deadline is not None:
            _call(deliver, request_id, self._deadline)
            return arrival
        self._subscriptions[request_id] = deliver
        sockets.send(
            self._requests,
            AddRequest(
                request_id,
                self.index,
                prompt_token_ids,
                params,
                arrival,
                final_only,
                first_of_request,
                lora,
            ),
        )
        return arrival

    async def update_adapter(self, name: str, path: str | None) -> LoRAAdapterUpdated:
        """Load (from ``path``) or unload (``path`` None) an adapter through the scheduler;
        its answer, or a 503 if the node stops first."""
        request_id = f"lora-update-{self.index}-{next(self._update_ids)}"
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._subscriptions[request_id] = answer.set_result
        message: LoadLoRAAdapter | UnloadLoRAAdapter = (
            UnloadLoRAAdapter(request_id, self.index, name)
            if path is None
            else LoadLoRAAdapter(request_id, self.index, name, path)
        )
        sockets.send(self._requests, message)
        try:
            result = await answer
        finally:
            self._subscriptions.pop(request_id, None)
        if isinstance(result, LoRAAdapterUpdated):
            return result
        return LoRAAdapterUpdated(request_id, 503, "the serving node is stopping")

    def abort(self, request_id: str) -> None:
        self._subscriptions.pop(request_id, None)
        sockets.send(self._requests, AbortRequest(request_id))

    def stop_sequence(self, request_id: str, index: int, stop: str) -> None:
        sockets.send(self._requests, StopSequence(request_id, index, stop))

    def forget(self, request_id: str) -> None:
        self._subscriptions.pop(request_id, None)

    def begin(self) -> None:
        self.in_flight += 1

    def end(self) -> None:
        self.in_flight -= 1
        self._report_idle()

    def _report_idle(self) -> None:
        if self.state == NodeState.DRAINING and self.in_flight == 0:
            sockets.send(self._control, ApiServerIdle(self.index))

    # ----- the inbox -----------------------------------------------------------------------

    async def _receive(self) -> None:
        where = f"api server {self.index}"
        while True:
            data = await self._inbox.recv()
            message = sockets.parse(data, where)
            if isinstance(message, RequestOutputs):
                for delta in message.deltas:
                    self._deliver(delta.request_id, delta, delta.finished)
            elif isinstance(message, KVEvents):
                self.kv_events.apply(message)
            elif isinstance(message, KVMap):
                self.kv_map.apply(message)
            elif isinstance(message, CacheLayout):
                self.kv_events.set_layout(message)
            elif isinstance(message, RequestRejected | LoRAAdapterUpdated):
                self._deliver(message.request_id, message, True)
            elif isinstance(message, LoRAAdapters):
                if self.on_adapters is not None:
                    self.on_adapters(message.adapters)
            elif isinstance(message, NodeReady | Drain | DrainDeadline | NodeFailed):
                self._obey(message)
            elif message is not None:
                log.warning("%s: ignored a %s message", where, type(message).__name__)

    def _obey(self, order: NodeReady | Drain | DrainDeadline | NodeFailed) -> None:
        """Take in one of the supervisor's orders."""
        if isinstance(order, NodeReady):
            if self.state == NodeState.STARTING:
                self.state = NodeState.READY
                log.info("the node is ready")
        elif isinstance(order, Drain):
            if self.state in (NodeState.STARTING, NodeState.READY):
                self.state = NodeState.DRAINING
                log.info("draining: %d requests in flight", self.in_flight)
                self.kv_events.close()
                self.kv_map.close()
                self._report_idle()
        elif isinstance(order, DrainDeadline):
            self._cut_off(order)
        else:
            self._fail(order)

    def _deliver(self, request_id: str, message: Any, last: bool) -> None:
        deliver = (
            self._subscriptions.pop(request_id, None)
            if last
            else self._subscriptions.get(request_id)
        )
        if deliver is not None:
            _call(deliver, request_id, message)

    def _fail(self, message: NodeFailed) -> None:
        self.state = NodeState.FAILED
        self.failure = message.reason
        self.kv_events.close()
        self.kv_map.close()
        log.error("the node failed: %s", message.reason)
        self._end_every_request(message)

    def _cut_off(self, message: DrainDeadline) -> None:
        self._deadline = message
        log.warning(
            "--shutdown-timeout %gs passed: ending %d requests in flight",
            message.timeout_s,
            self.in_flight,
        )
        for request_id in self._end_every_request(message):
            # The scheduler stops working on it in the moment before the node stops.
            sockets.send(self._requests, AbortRequest(request_id))

    def _end_every_request(self, message: DrainDeadline | NodeFailed) -> list[str]:
        """``message`` is the last each request in flight receives; their ids."""
        subscriptions, self._subscriptions = self._subscriptions, {}
        for request_id, deliver in subscriptions.items():
            _call(deliver, request_id, message)
        return list(subscriptions)


def _exit_if_failed(task: asyncio.Task[None]) -> None:
    # An API server that no longer hears the scheduler would hang every request (or feed a
    # stale cache map): better to die, which the supervisor turns into a restart of the node.
    if not task.cancelled() and task.exception() is not None:
        log.critical("the inbox reader failed", exc_info=task.exception())
        os._exit(1)


def _call(deliver: Deliver, request_id: str, message: Any) -> None:
    try:
        deliver(message)
    except Exception:  # one request's failure must not stop the inbox for all the others
        log.exception("failed to apply a message for request %s", request_id)
