"""Two tensor-parallel workers on the CPU (gloo): same greedy tokens as one; a killed worker
takes the node down fast and visibly."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm_testing.serve_harness import DEMO_MODEL, Server, start_server

PROMPTS = ["Tensor parallel ranks", "Every rank holds half", "Gloo sums the partial"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(
        tmp_path_factory.mktemp("tp"), "--tensor-parallel-size", "2", api_key="tp-secret"
    )
    yield running
    running.stop()


def test_two_ranks_give_the_greedy_tokens_of_one(server: Server, offline: LLM) -> None:
    one_rank = offline
    client = server.client()
    for prompt in PROMPTS:
        (want,) = one_rank.generate(
            [prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False
        )
        got = client.completions.create(
            model=DEMO_MODEL,
            prompt=prompt,
            max_tokens=16,
            temperature=0,
            logprobs=0,
            extra_body={"ignore_eos": True},
        )
        assert got.choices[0].text == want.outputs[0].text
        tokenizer = one_rank.get_tokenizer()
        assert got.choices[0].logprobs.tokens == [
            tokenizer.decode([t]) for t in want.outputs[0].token_ids
        ]


def test_killing_a_worker_fails_requests_and_exits_nonzero_within_5s(server: Server) -> None:
    events: list[dict] = []
    streaming = threading.Event()

    def stream() -> None:
        body = {
            "model": DEMO_MODEL,
            "prompt": "In flight",
            "max_tokens": 1500,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream(
            "POST",
            f"{server.url}/v1/completions",
            json=body,
            timeout=30,
            headers={"Authorization": "Bearer tp-secret"},
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    streaming.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert streaming.wait(30)
    os.kill(server.pid("worker 1"), signal.SIGKILL)
    killed = time.monotonic()
    health: list[int] = []
    while server.process.poll() is None and time.monotonic() - killed < 10:
        health.append(server.health())
        time.sleep(0.05)
    elapsed = time.monotonic() - killed
    assert server.process.poll() not in (None, 0)
    assert elapsed < 5.0, elapsed
    assert 200 not in health[3:], health  # failing from at most a few polls after the kill
    assert 503 in health, health
    reader.join(10)
    assert not reader.is_alive()
    error = events[-1].get("error")
    assert error is not None, events[-1]
    assert "worker 1" in error["message"] and "SIGKILL" in error["message"]
    assert "worker 1" in server.log() and "was killed by SIGKILL" in server.log()
