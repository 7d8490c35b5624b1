"""An API server's KV-events feed over real sockets: the app and its engine client on a real
port, fed the messages a scheduler and a supervisor send over real ZeroMQ sockets. What a
whole node does is in tests/serve/test_serve_kv_events.py; here each case is driven exactly:
503 until ready, the order and numbering of lines, late snapshots, heartbeats from the API
server itself, a subscriber that does not read, and the end on drain."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
import zmq

from pagedllm.api import kv_events
from pagedllm.api.app import build_app
from pagedllm.api.engine_client import EngineClient, NodeState
from pagedllm.api.serving import ServingContext
from pagedllm.core.block_manager import root_hash
from pagedllm.core.kv_events import FEED_VERSION, CacheEvent, NodeLoad, group_updates
from pagedllm.ipc import messages, sockets
from pagedllm.runtime.metrics import RequestRecorder
from pagedllm_testing.serve_harness import free_port

LAYOUT = messages.CacheLayout(block_size=16, hash_seed=7, num_blocks=64)
ROOT = root_hash(7)


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


@dataclass
class Node:
    """The API server under test, and the sockets the test plays the scheduler with."""

    url: str
    client: EngineClient
    scheduler: zmq.Socket

    def send(self, message: messages.Message) -> None:
        sockets.send(self.scheduler, message)

    def events(self, events: list[CacheEvent], load: NodeLoad | None = None) -> None:
        self.send(messages.KVEvents(group_updates(events), load or NodeLoad(1, 0, 0.5)))

    async def until(self, condition: Callable[[], bool], what: str) -> None:
        for _ in range(500):
            if condition():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"timed out waiting for {what}")

    async def ready(self) -> None:
        self.send(messages.NodeReady())
        self.send(LAYOUT)
        await self.until(lambda: self.client.kv_events.ready, "the feed to be ready")


@asynccontextmanager
async def api_server() -> AsyncIterator[Node]:
    paths = sockets.make_ipc_dir()
    zmq_ctx = zmq.Context()
    client = EngineClient(paths, 0)
    client.start()
    serving = ServingContext(
        client=client,
        tokenizer=None,  # the feed never tokenizes
        model_names=["m"],
        model_dir="m",
        max_model_len=64,
        vocab_size=100,
        metrics=RequestRecorder("m"),
    )
    port = free_port()
    config = uvicorn.Config(
        build_app(serving, None), host="127.0.0.1", port=port, log_config=None, lifespan="off"
    )
    server = uvicorn.Server(config)
    serve = asyncio.get_running_loop().create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        yield Node(f"http://127.0.0.1:{port}", client, sockets.push(zmq_ctx, paths.api(0)))
    finally:
        server.should_exit = True
        await asyncio.wait({serve}, timeout=10)
        client.close()
        zmq_ctx.destroy(linger=0)
        shutil.rmtree(paths.directory, ignore_errors=True)


def run(test: Callable[[Node], Awaitable[None]]) -> None:
    async def main() -> None:
        async with api_server() as node:
            await test(node)

    asyncio.run(main())


class Subscriber:
    """Reads one subscription's lines into ``lines`` until the stream ends."""

    def __init__(self, http: httpx.AsyncClient, url: str) -> None:
        self.lines: list[dict[str, Any]] = []
        self.task = asyncio.get_running_loop().create_task(self._read(http, url))

    async def _read(self, http: httpx.AsyncClient, url: str) -> None:
        async with http.stream("GET", f"{url}/v1/kv_events") as response:
            assert response.status_code == 200
            assert response.headers["content-type"] == "application/x-ndjson"
            async for line in response.aiter_lines():
                self.lines.append(json.loads(line))

    async def wait_lines(self, count: int) -> list[dict[str, Any]]:
        for _ in range(1000):
            if len(self.lines) >= count or self.task.done():
                break
            await asyncio.sleep(0.01)
        if self.task.done() and self.task.exception():
            raise self.task.exception()  # type: ignore[misc]
        assert len(self.lines) >= count, self.lines
        return self.lines

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


def replay(lines: list[dict[str, Any]]) -> dict[str, str]:
    """The map a subscriber builds from a snapshot and the updates after it."""
    blocks = dict(lines[0]["blocks"])
    for seq, line in enumerate(lines[1:], lines[0]["seq"] + 1):
        assert line["type"] == "update" and line["seq"] == seq
        for removed in line["removed"]:
            del blocks[removed]
        for stored, parent in line["stored"]:
            blocks[stored] = parent
    return blocks


def test_503_until_the_node_is_ready_and_the_scheduler_said_how_it_hashes() -> None:
    async def test(node: Node) -> None:
        async with httpx.AsyncClient() as http:
            answer = await http.get(f"{node.url}/v1/kv_events")
            assert answer.status_code == 503 and answer.headers["Retry-After"] == "1"
            assert answer.json()["error"]["code"] == "starting"
            node.send(messages.NodeReady())
            await node.until(lambda: node.client.state == NodeState.READY, "ready")
            answer = await http.get(f"{node.url}/v1/kv_events")
            assert answer.status_code == 503
            assert answer.json()["error"]["code"] == "starting"
            node.send(LAYOUT)
            # The layout crosses a socket: subscribe once the API server has it.
            await node.until(lambda: node.client.kv_events.ready, "the feed to be ready")
            subscriber = Subscriber(http, node.url)
            (snapshot,) = await subscriber.wait_lines(1)
            assert snapshot == {
                "type": "snapshot",
                "version": FEED_VERSION,
                "seq": 0,
                "block_size": 16,
                "hash_seed": 7,
                "num_blocks": 64,
                "blocks": [],
                "load": {"running": 0, "waiting": 0, "kv_usage": 0.0},
                "adapters": [],
            }
            await subscriber.close()

    run(test)


def test_lines_in_order_late_snapshots_and_heartbeats() -> None:
    async def test(node: Node) -> None:
        await node.ready()
        async with httpx.AsyncClient(timeout=10) as http:
            early = Subscriber(http, node.url)
            await early.wait_lines(1)
            # a stored then removed in one step: two lines, or removed-first would keep it.
            node.events([(h(1), ROOT), (h(2), h(1)), (h(1), None)], NodeLoad(2, 1, 0.25))
            # a back after its child: the snapshot still lists it first.
            node.events([(h(1), ROOT), (h(3), h(2))], NodeLoad(2, 0, 0.5))
            lines = await early.wait_lines(4)
            assert [(line["stored"], line["removed"]) for line in lines[1:4]] == [
                ([[h(1).hex(), ROOT.hex()], [h(2).hex(), h(1).hex()]], []),
                ([], [h(1).hex()]),
                ([[h(1).hex(), ROOT.hex()], [h(3).hex(), h(2).hex()]], []),
            ]
            assert lines[1]["load"] == {"running": 2, "waiting": 1, "kv_usage": 0.25}
            assert lines[3]["load"] == {"running": 2, "waiting": 0, "kv_usage": 0.5}

            late = Subscriber(http, node.url)
            (snapshot,) = await late.wait_lines(1)
            assert snapshot["seq"] == lines[3]["seq"]
            assert snapshot["blocks"] == [
                [h(1).hex(), ROOT.hex()],
                [h(2).hex(), h(1).hex()],
                [h(3).hex(), h(2).hex()],
            ]
            assert dict(snapshot["blocks"]) == replay(lines[:4])

            # The scheduler falls silent (a long step): the API server keeps the feed alive
            # with the last load, and both subscribers get the same lines under one seq.
            before = len(early.lines)
            await asyncio.sleep(2.5)
            heartbeats = early.lines[before:]
            assert len(heartbeats) >= 2
            for line in heartbeats:
                assert (line["stored"], line["removed"]) == ([], [])
                assert line["load"] == {"running": 2, "waiting": 0, "kv_usage": 0.5}
            common = min(len(late.lines) - 1, len(early.lines) - 4)
            assert common >= 2
            assert late.lines[1 : 1 + common] == early.lines[4 : 4 + common]
            await early.close()
            await late.close()

    run(test)


def test_a_subscriber_that_does_not_read_is_dropped_and_the_others_keep_up() -> None:
    async def test(node: Node) -> None:
        await node.ready()
        feed = node.client.kv_events
        host, port = node.url.removeprefix("http://").split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(f"GET /v1/kv_events HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        await node.until(lambda: len(feed.subscribers) == 1, "the stalled subscriber")
        stalled = next(iter(feed.subscribers))
        async with httpx.AsyncClient(timeout=30) as http:
            keeping_up = Subscriber(http, node.url)
            await keeping_up.wait_lines(1)
            # Lines of some 3.5 kB, far more than socket buffers and the queue hold.
            batches = 3 * kv_events.MAX_QUEUED_LINES
            for batch in range(batches):
                first = 1000 + batch * 50
                node.events([(h(i), ROOT) for i in range(first, first + 50)])
                if batch % 20 == 0:
                    await asyncio.sleep(0.01)
            await node.until(lambda: stalled not in feed.subscribers, "the stalled one dropped")
            assert stalled.lines.qsize() <= 1  # emptied, with the end of its stream
            lines = await keeping_up.wait_lines(batches + 1)
            assert len(replay(lines)) == batches * 50
            assert len(feed.subscribers) == 1
            await keeping_up.close()
        # The stalled one's stream ended (the chunked body's last chunk) where it stood.
        received = b""
        while not received.endswith(b"0\r\n\r\n"):
            chunk = await asyncio.wait_for(reader.read(1 << 20), 10)
            assert chunk, "the connection closed without ending the stream"
            received += chunk
        writer.close()

    run(test)


def test_the_feed_ends_on_drain_and_is_refused_after() -> None:
    async def test(node: Node) -> None:
        await node.ready()
        async with httpx.AsyncClient(timeout=10) as http:
            subscribers = [Subscriber(http, node.url) for _ in range(3)]
            for subscriber in subscribers:
                await subscriber.wait_lines(1)
            node.send(messages.Drain())
            done, _ = await asyncio.wait({s.task for s in subscribers}, timeout=10)
            assert len(done) == 3 and all(t.exception() is None for t in done)
            answer = await http.get(f"{node.url}/v1/kv_events")
            assert answer.status_code == 503
            assert answer.json()["error"]["code"] == "draining"
        assert not node.client.kv_events.subscribers

    run(test)


def test_heartbeats_stay_quiet_without_subscribers() -> None:
    async def test(node: Node) -> None:
        await node.ready()
        await asyncio.sleep(1.5)
        # No line was made for nobody: the first subscriber starts at the updates applied.
        node.events([(h(1), ROOT)])
        await node.until(lambda: node.client.kv_events.seq == 1, "the update")
        assert node.client.kv_events.blocks == {h(1): ROOT}
        assert not node.client.kv_events.subscribers

    run(test)
