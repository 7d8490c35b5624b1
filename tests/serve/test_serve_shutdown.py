"""SIGTERM with requests that outlast --shutdown-timeout: each ends with an error saying so."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import openai

from pagedllm_testing.serve_harness import DEMO_MODEL, Server, start_server

SHUTDOWN_TIMEOUT_S = 2
# Far more than the node generates in SHUTDOWN_TIMEOUT_S, well within the demo model's length.
LONG = {"model": DEMO_MODEL, "max_tokens": 1500, "ignore_eos": True}


class Stream(threading.Thread):
    """A long streamed completion read in the background, keeping every ``data:`` line."""

    def __init__(self, server: Server, index: int) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.index = index
        self.lines: list[str] = []
        self.started = threading.Event()

    def run(self) -> None:
        body = {**LONG, "prompt": f"Cut off {self.index}", "stream": True}
        try:
            with httpx.stream(
                "POST", f"{self.server.url}/v1/completions", json=body, timeout=60
            ) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line[6:])
                        self.started.set()
        finally:
            self.started.set()


class WholeRequest(threading.Thread):
    """A long non-streamed completion; keeps the error the openai client raised."""

    def __init__(self, server: Server) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.error: openai.APIStatusError | None = None

    def run(self) -> None:
        try:
            self.server.client().completions.create(
                model=DEMO_MODEL,
                prompt="Cut off whole",
                max_tokens=LONG["max_tokens"],
                extra_body={"ignore_eos": True},
            )
        except openai.APIStatusError as error:
            self.error = error


def assert_shutdown_error(error: dict) -> None:
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == "server_shutdown"
    assert error["type"] == "service_unavailable_error"
    assert f"--shutdown-timeout of {SHUTDOWN_TIMEOUT_S} s passed" in error["message"]


def test_requests_past_the_shutdown_timeout_end_with_an_error_and_the_node_exits(
    tmp_path: Path,
) -> None:
    server = start_server(tmp_path, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S))
    try:
        streams = [Stream(server, i) for i in range(3)]
        whole = WholeRequest(server)
        for thread in (*streams, whole):
            thread.start()
        for stream in streams:
            assert stream.started.wait(60)
        server.wait_until(
            lambda: server.metric("vllm:num_requests_running") == 4,
            what="all four requests to run",
        )
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        for thread in (*streams, whole):
            thread.join(30)
            assert not thread.is_alive()
        assert server.process.wait(15) == 0
        assert time.monotonic() - signalled < 15
    finally:
        server.stop()

    for stream in streams:
        *tokens, last_event, done = stream.lines
        assert done == "[DONE]"
        assert tokens and all("error" not in json.loads(t) for t in tokens)
        body = json.loads(last_event)
        assert list(body) == ["error"], body
        assert_shutdown_error(body["error"])
    assert whole.error is not None and whole.error.status_code == 503
    assert whole.error.response.headers["Retry-After"] == "1"
    assert_shutdown_error(whole.error.response.json()["error"])
    assert "ending them" in server.log()
    assert "Traceback" not in server.log()
