"""The front keeps answering while large prompts are tokenized, and refuses requests that ask
for more work than its caps allow, naming the cap."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from pagedllm_testing.serve_harness import DEMO_MODEL, Server, start_server

MAX_PROMPTS = 3
MAX_N = 4
MAX_REQUEST_TOKENS = 100
LARGE_PROMPT_BYTES = 2_000_000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(
        tmp_path_factory.mktemp("front"),
        "--max-prompts-per-request",
        str(MAX_PROMPTS),
        "--max-n",
        str(MAX_N),
        "--max-request-tokens",
        str(MAX_REQUEST_TOKENS),
    )
    yield running
    running.stop()


def large_prompt(seed: int) -> str:
    """2 MB of varied words (repeated text would hit the tokenizer's caches)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(5000)]
    return " ".join(rng.choices(words, k=LARGE_PROMPT_BYTES // 5))[:LARGE_PROMPT_BYTES]


def test_health_answers_while_large_prompts_are_tokenized(server: Server) -> None:
    prompts = [large_prompt(seed) for seed in range(4)]
    answers: dict[str, list[httpx.Response]] = {"/tokenize": [], "/v1/completions": []}

    def send(path: str, prompt: str) -> None:
        body = {"model": DEMO_MODEL, "prompt": prompt, "max_tokens": 1}
        answers[path].append(httpx.post(f"{server.url}{path}", json=body, timeout=300))

    senders = [
        threading.Thread(target=send, args=(path, prompt)) for prompt in prompts for path in answers
    ]
    for sender in senders:
        sender.start()
    health: list[float] = []
    small: list[str] = []
    tokenizing_after_small = False
    client = server.client()
    with httpx.Client(base_url=server.url, timeout=30) as probe:
        while any(s.is_alive() for s in senders):
            started = time.monotonic()
            assert probe.get("/health").status_code == 200
            health.append(time.monotonic() - started)
            if not small:
                out = client.completions.create(model=DEMO_MODEL, prompt="hi", max_tokens=2)
                small.append(out.choices[0].text)
                tokenizing_after_small = any(s.is_alive() for s in senders)
            time.sleep(0.05)
    for sender in senders:
        sender.join()

    assert max(health) < 1.0, f"/health took up to {max(health):.2f} s over {len(health)} calls"
    assert len(health) >= 5  # the probe really ran alongside the tokenizing
    assert small, "the small completion was not answered"
    # It did not wait behind the large prompts: they were still being tokenized.
    assert tokenizing_after_small
    for response in answers["/tokenize"]:
        assert response.status_code == 200, response.text
        assert response.json()["count"] > LARGE_PROMPT_BYTES // 10
    for response in answers["/v1/completions"]:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert f"its {LARGE_PROMPT_BYTES} bytes of text" in error["message"]


def test_a_prompt_too_long_in_bytes_is_refused_with_the_lengths(server: Server) -> None:
    """A chat whose rendered text cannot fit is refused before tokenizing, with the lengths."""
    with pytest.raises(openai.BadRequestError) as raised:
        server.client().chat.completions.create(
            model=DEMO_MODEL,
            messages=[{"role": "user", "content": "x" * 200_000}],
            max_tokens=1,
        )
    body: Any = raised.value.body
    assert body["code"] == "context_length_exceeded"
    assert "maximum context length is" in body["message"]
    assert "at least" in body["message"]


def test_too_many_prompts_are_refused_naming_the_cap(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        server.client().completions.create(
            model=DEMO_MODEL, prompt=["hi"] * (MAX_PROMPTS + 2), max_tokens=1
        )
    body: Any = raised.value.body
    assert body["message"] == (
        f"this request asks for {MAX_PROMPTS + 2} prompts; "
        f"--max-prompts-per-request is {MAX_PROMPTS}"
    )
    out = server.client().completions.create(
        model=DEMO_MODEL, prompt=["hi"] * MAX_PROMPTS, max_tokens=1
    )
    assert len(out.choices) == MAX_PROMPTS


@pytest.mark.parametrize("field", ["n", "best_of"])
def test_too_many_samples_are_refused_naming_the_cap(server: Server, field: str) -> None:
    body = {"model": DEMO_MODEL, "prompt": "hi", "max_tokens": 1, field: MAX_N + 1}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] == f"this request asks for {field}={MAX_N + 1}; --max-n is {MAX_N}"
    assert error["param"] == field
    with pytest.raises(openai.BadRequestError) as raised:
        server.client().chat.completions.create(
            model=DEMO_MODEL, messages=[{"role": "user", "content": "hi"}], n=MAX_N + 1
        )
    assert "--max-n is" in raised.value.body["message"]  # type: ignore[index]


def test_too_many_tokens_in_all_are_refused_naming_the_cap(server: Server) -> None:
    client = server.client()
    # 2 prompts x 3 sequences x 20 tokens = 120 > 100
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=DEMO_MODEL, prompt=["a", "b"], n=3, max_tokens=20)
    message = raised.value.body["message"]  # type: ignore[index]
    assert "up to 120 tokens" in message
    assert f"--max-request-tokens is {MAX_REQUEST_TOKENS}" in message
    # A chat without max_tokens may run to the context's end: refused too.
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=DEMO_MODEL, messages=[{"role": "user", "content": "hi"}]
        )
    assert "--max-request-tokens" in raised.value.body["message"]  # type: ignore[index]
    out = client.completions.create(model=DEMO_MODEL, prompt=["a", "b"], n=2, max_tokens=20)
    assert len(out.choices) == 4
