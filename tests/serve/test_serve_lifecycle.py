"""The node under load, under junk on its sockets, and on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgpack
import openai
import pytest
import torch
import zmq

from pagedllm.core.request_delta import RequestDelta
from pagedllm.core.step_plan import RunningUpdate, StepPlan
from pagedllm.ipc import messages
from pagedllm.sampling_params import SamplingParams
from pagedllm_testing.serve_harness import (
    DEMO_MODEL,
    TORCH_LIBRARY,
    Server,
    mapped_files,
    start_server,
)

SHUTDOWN_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(
        tmp_path_factory.mktemp("lifecycle"),
        "--api-server-count",
        "2",
        "--api-server-nice",
        "5",
        "--shutdown-timeout",
        str(SHUTDOWN_TIMEOUT_S),
    )
    yield running
    running.stop()


async def _stream(client: httpx.AsyncClient, index: int, keep: bool) -> int | None:
    """One streamed completion; the completion tokens when read to the end, None when the
    client hung up after two chunks."""
    body = {
        "model": DEMO_MODEL,
        "prompt": f"Stream number {index}",
        "stream": True,
        "ignore_eos": True,
        "max_tokens": 24 if keep else 1000,
        "stream_options": {"include_usage": True},
    }
    chunks = 0
    usage = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return usage
            payload = json.loads(line[6:])
            assert "error" not in payload, payload
            chunks += 1
            usage = (payload.get("usage") or {}).get("completion_tokens", usage)
            if not keep and chunks == 2:
                return None  # leaving the block closes the connection mid-stream
    raise AssertionError("the stream ended without [DONE]")


def test_200_streams_with_half_hanging_up_early(server: Server) -> None:
    async def run() -> list[int | None]:
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as client:
            return await asyncio.gather(*(_stream(client, i, keep=i % 2 == 0) for i in range(200)))

    results = asyncio.run(run())
    assert results[0::2] == [24] * 100
    assert results[1::2] == [None] * 100
    # The ones that hung up asked for 1000 tokens each: only aborting them empties the node
    # this soon, and frees their blocks.
    server.wait_until(
        lambda: server.metric("vllm:num_requests_running") == 0,
        timeout=20,
        what="every request to finish or be aborted",
    )
    assert server.metric("vllm:num_requests_waiting") == 0
    assert server.metric("vllm:kv_cache_usage_perc") == 0.0
    assert server.metric("vllm:request_success_total", finished_reason="abort") >= 100
    assert server.process.poll() is None and server.health() == 200
    assert "Traceback" not in server.log()


def test_a_client_leaving_a_whole_response_request_aborts_it(server: Server) -> None:
    aborted = server.metric("vllm:request_success_total", finished_reason="abort")
    body = {
        "model": DEMO_MODEL,
        "prompt": "Never read",
        "max_tokens": 2000,
        "n": 4,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.0)
    # Generating it all would take far longer than this.
    server.wait_until(
        lambda: server.metric("vllm:num_requests_running") == 0,
        timeout=5,
        what="the abandoned request to be aborted",
    )
    assert server.metric("vllm:kv_cache_usage_perc") == 0.0
    assert server.metric("vllm:request_success_total", finished_reason="abort") == aborted + 1


def test_the_api_servers_yield_the_cpu_to_the_worker(server: Server) -> None:
    """--api-server-nice 5: the HTTP fronts run niced, the compute does not."""
    for role in ("api server 0", "api server 1"):
        assert os.getpriority(os.PRIO_PROCESS, server.pid(role)) == 5
    for role in ("worker 0", "scheduler"):
        assert os.getpriority(os.PRIO_PROCESS, server.pid(role)) == 0


def test_the_api_servers_never_load_torch(server: Server) -> None:
    torch_dir = str(Path(torch.__file__).parent) + "/"
    # Where torch is loaded, the check sees it.
    assert any(TORCH_LIBRARY.search(f) for f in mapped_files(server.pid("worker 0")))
    for role in ("api server 0", "api server 1"):
        pid = server.pid(role)
        files = mapped_files(pid)
        assert any("tokenizers" in f for f in files)  # the process that tokenizes
        assert [f for f in files if TORCH_LIBRARY.search(f) or f.startswith(torch_dir)] == []
        # A fresh interpreter, not a fork of the supervisor (which holds torch).
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            assert b"pagedllm.serve.api_server_process" in cmdline.read()


def test_malformed_messages_are_dropped_and_the_node_keeps_serving(server: Server) -> None:
    junk = [
        b"",
        b"\x00\xffnot msgpack at all",
        msgpack.packb({"not": "an envelope"}),
        msgpack.packb(["no_such_message", 1, []]),
        msgpack.packb(["add_request", 99, []]),  # a schema version this node does not speak
        msgpack.packb(["add_request", 1, ["id", 0, b"\x01\x02", [], 0.0]]),
        msgpack.packb(["step_plan", 1, [1, [], [b"\x01"] * 7, b"", b"", {}, b"", []]]),
        # Well formed, but for an API server that does not exist.
        messages.encode(messages.AddRequest("stray", 7, [1, 2], SamplingParams(), 0.0)),
        # Well formed outputs for a request nobody waits for.
        messages.encode(messages.RequestOutputs([RequestDelta("nobody", finished=True)])),
        # A well-formed step plan for sequences no worker holds.
        messages.encode(
            StepPlan(10**6, running=[RunningUpdate(424242, [1], 0, [], 0)], scheduled=[(424242, 1)])
        ),
    ]
    ctx = zmq.Context()
    try:
        for name in ("requests", "results", "control", "api-0", "api-1", "plans-0"):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(f"ipc://{server.socket_path(name)}")
            for data in junk:
                sock.send(data)
            sock.close()
    finally:
        ctx.term()
    for i in range(4):
        # EOS ignored: a sampled EOS would end it early (rarely: about 1 in 200 here).
        out = server.client().completions.create(
            model=DEMO_MODEL,
            prompt=f"after junk {i}",
            max_tokens=3,
            extra_body={"ignore_eos": True},
        )
        assert out.usage.completion_tokens == 3
    # Seven undecodable messages on each of six sockets, each logged as it is dropped.
    server.wait_until(
        lambda: server.log().count("dropped a malformed message") >= 7 * 6,
        what="the junk to be logged",
    )
    assert "refused step plan 1000000: running update for unknown sequence" in server.log()
    assert "ignored the workers' refusal of step plan 1000000" in server.log()
    assert server.process.poll() is None and server.health() == 200


# Long enough that the streams are still running when /health turns 503 and "too late" is refused.
DRAINED_TOKENS = 400


def test_sigterm_finishes_streams_in_flight_then_exits_zero(server: Server) -> None:
    client = server.client()
    started = threading.Barrier(5)
    finished: dict[int, tuple[str, int]] = {}

    def stream(i: int) -> None:
        chunks = client.completions.create(
            model=DEMO_MODEL,
            prompt=f"Draining {i}",
            max_tokens=DRAINED_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        parts = []
        for n, chunk in enumerate(chunks):
            if n == 0:
                started.wait()
            parts.extend(c.text for c in chunk.choices)
            if chunk.usage is not None:
                finished[i] = ("".join(parts), chunk.usage.completion_tokens)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    started.wait(timeout=60)
    server.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    server.wait_until(lambda: server.health() == 503, what="/health to turn 503")
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model=DEMO_MODEL, prompt="too late", max_tokens=2)
    assert refused.value.status_code == 503
    assert "shutting down" in refused.value.body["message"]
    for thread in threads:
        thread.join(SHUTDOWN_TIMEOUT_S)
    assert sorted(finished) == [0, 1, 2, 3]
    assert all(tokens == DRAINED_TOKENS for _, tokens in finished.values())
    assert server.process.wait(SHUTDOWN_TIMEOUT_S) == 0
    assert time.monotonic() - signalled < SHUTDOWN_TIMEOUT_S
    assert "drained" in server.log()
