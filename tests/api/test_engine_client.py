"""An API server's engine client at the shutdown deadline, over real ZeroMQ sockets: the
supervisor's DrainDeadline ends every request in flight, and any that comes after it."""

from __future__ import annotations

import asyncio
import shutil
from typing import Any

import zmq

from pagedllm.api.engine_client import EngineClient
from pagedllm.ipc import messages, sockets
from pagedllm.sampling_params import SamplingParams


def test_the_shutdown_deadline_ends_requests_in_flight_and_later_ones() -> None:
    paths = sockets.make_ipc_dir()
    ctx = zmq.Context()
    scheduler = sockets.pull(ctx, paths.requests)
    received: dict[str, list[Any]] = {"running": [], "late": []}

    def sent_to_scheduler() -> list[Any]:
        out = []
        while scheduler.poll(500):
            out.append(messages.decode(scheduler.recv()))
        return out

    async def run() -> None:
        client = EngineClient(paths, 0)
        client.start()
        try:
            to_client = sockets.push(ctx, paths.api(0))
            client.add("running", [1, 2], SamplingParams(), received["running"].append)
            sockets.send(to_client, messages.DrainDeadline(2.0))
            for _ in range(100):
                if received["running"]:
                    break
                await asyncio.sleep(0.02)
            client.add("late", [3], SamplingParams(), received["late"].append)
        finally:
            client.close()

    try:
        asyncio.run(run())
        assert received == {
            "running": [messages.DrainDeadline(2.0)],
            "late": [messages.DrainDeadline(2.0)],
        }
        sent = sent_to_scheduler()
        # The running one was sent and then aborted; the late one never reached the scheduler.
        assert [type(m).__name__ for m in sent] == ["AddRequest", "AbortRequest"]
        assert [m.request_id for m in sent] == ["running", "running"]
    finally:
        ctx.destroy(linger=0)
        shutil.rmtree(paths.directory, ignore_errors=True)
