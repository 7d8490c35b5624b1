"""Faults a node must not survive silently, and forged input it must survive: a worker that
stops answering, a plan the workers refuse, out-of-vocabulary ids sent straight to the
scheduler, and the supervisor killed outright."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import zmq

from pagedllm.core.step_plan import StepPlan
from pagedllm.ipc import messages
from pagedllm.sampling_params import SamplingParams
from pagedllm_testing.serve_harness import DEMO_MODEL, Server, start_server


class Stream(threading.Thread):
    """A long streamed completion read in the background, keeping every event."""

    def __init__(self, server: Server) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.events: list[dict] = []
        self.started = threading.Event()

    def run(self) -> None:
        body = {
            "model": DEMO_MODEL,
            "prompt": "A stream in flight",
            "max_tokens": 1500,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream(
                "POST", f"{self.server.url}/v1/completions", json=body, timeout=120
            ) as response:
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        self.events.append(json.loads(line[6:]))
                        self.started.set()
        except httpx.HTTPError:
            pass  # the node went away; what it sent before is in self.events
        finally:
            self.started.set()


def push(server: Server, socket_name: str, *payloads: messages.Message) -> None:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(f"ipc://{server.socket_path(socket_name)}")
        for payload in payloads:
            sock.send(messages.encode(payload))
        sock.close()
    finally:
        ctx.term()


def wait_for_exit(server: Server, timeout: float) -> list[int]:
    """The /health statuses seen until the node exits (fails the test if it does not)."""
    health: list[int] = []
    deadline = time.monotonic() + timeout
    while server.process.poll() is None:
        assert time.monotonic() < deadline, f"the node is still running\n{server.log()[-3000:]}"
        health.append(server.health())
        time.sleep(0.1)
    return health


def assert_failed_with(stream: Stream, server: Server, health: list[int], reason: str) -> None:
    assert server.process.returncode not in (None, 0)
    assert 503 in health or not health, health
    stream.join(30)
    assert not stream.is_alive()
    error = stream.events[-1].get("error")
    assert error is not None, stream.events[-1]
    assert reason in error["message"], error
    assert reason in server.log()


def test_a_worker_that_stops_answering_fails_the_node_at_its_step_deadline(
    tmp_path: Path,
) -> None:
    server = start_server(tmp_path, "--step-timeout", "2")
    worker = server.pid("worker 0")
    try:
        stream = Stream(server)
        stream.start()
        assert stream.started.wait(60) and stream.events
        os.kill(worker, signal.SIGSTOP)  # alive, holding its sockets, answering nothing
        health = wait_for_exit(server, timeout=60)
        assert_failed_with(stream, server, health, "is overdue: no result from the workers")
    finally:
        with pytest.raises(ProcessLookupError):
            os.kill(worker, signal.SIGCONT)  # the supervisor took it down with the node
        server.stop()


def test_a_plan_the_workers_refuse_fails_the_node_with_the_reason(tmp_path: Path) -> None:
    """A worker whose state no longer matches the scheduler's (here: told by a forged plan to
    forget every sequence) refuses the next real plan; the node fails at once, naming it."""
    server = start_server(tmp_path)
    try:
        stream = Stream(server)
        stream.start()
        assert stream.started.wait(60) and stream.events
        push(server, "plans-0", StepPlan(10**6, finished=list(range(64))))
        health = wait_for_exit(server, timeout=60)
        assert_failed_with(stream, server, health, "the workers refused step plan")
        assert "running update for unknown sequence" in server.log()
    finally:
        server.stop()


def test_out_of_vocabulary_ids_sent_to_the_scheduler_are_refused_and_it_keeps_serving(
    tmp_path: Path,
) -> None:
    server = start_server(tmp_path)
    try:
        vocab = server.client().models.list()  # the node is up
        assert vocab.data
        forged = [
            messages.AddRequest(f"forged-{i}", 0, ids, SamplingParams(max_tokens=4), 0.0)
            for i, ids in enumerate([[10**6], [1, 2, -5], [2**40]])
        ]
        push(server, "requests", *forged)
        for i in range(3):
            out = server.client().completions.create(
                model=DEMO_MODEL,
                prompt=f"still serving {i}",
                max_tokens=3,
                extra_body={"ignore_eos": True},
            )
            assert out.usage.completion_tokens == 3
        assert "refused step plan" not in server.log()
        assert server.metric("vllm:request_success_total") == 3
        assert server.process.poll() is None and server.health() == 200
    finally:
        server.stop()


def test_nothing_of_the_node_remains_after_its_supervisor_is_killed(tmp_path: Path) -> None:
    server = start_server(tmp_path)
    children = {
        int(pid)
        for pid in re.findall(r"\[(?:worker|scheduler|api server)[^\]]* pid (\d+)\]", server.log())
    }
    (ipc_dir,) = tmp_path.glob("pagedllm-*")
    assert len(children) == 3 and any(ipc_dir.iterdir())
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait(10)
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in children):
        assert time.monotonic() < deadline, "children outlived the supervisor"
        time.sleep(0.1)
    assert not ipc_dir.exists()
    assert list(tmp_path.glob("pagedllm-*")) == []
