"""Every error answers with its status and OpenAI's error body, and the server keeps serving."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm_testing.serve_harness import Server, oversized_chunks, start_server

API_KEY = "sk-test-key"
MODEL = "errors-model"
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # The key comes from the environment, as the Kubernetes operator mounts it.
    running = start_server(
        tmp_path_factory.mktemp("errors"),
        "--served-model-name",
        MODEL,
        "other-name",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        "1",
        "--max-waiting",
        "1",
        env={"PAGEDLLM_API_KEY": API_KEY},
    )
    running.api_key = API_KEY
    yield running
    running.stop()


def post(
    server: Server,
    path: str,
    body: Any = None,
    *,
    content: bytes | Iterator[bytes] | None = None,
    key: str | None = API_KEY,
) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    if content is None:
        content = json.dumps(body).encode()  # ASCII escapes, as any JSON encoder may send
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60)


def assert_error(response: httpx.Response, status: int, *fragments: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    return error


def test_api_key_is_required_on_the_api_but_not_on_probes(server: Server) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    error = assert_error(post(server, "/v1/completions", body, key=None), 401, "API key")
    assert error["type"] == "authentication_error"
    assert_error(post(server, "/v1/completions", body, key="wrong"), 401)
    assert_error(post(server, "/tokenize", {"prompt": "hi"}, key=None), 401)
    with pytest.raises(openai.AuthenticationError) as raised:
        server.client(api_key="wrong").models.list()
    assert raised.value.status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    assert server.client().completions.create(model=MODEL, prompt="hi", max_tokens=1).choices


def test_unknown_model_is_404_and_every_served_name_works(server: Server) -> None:
    client = server.client()
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="gpt-nope", prompt="hi", max_tokens=1)
    assert raised.value.body["code"] == "model_not_found"
    assert "gpt-nope" in raised.value.body["message"]
    out = client.completions.create(model="other-name", prompt="hi", max_tokens=1)
    assert out.model == MODEL
    response = httpx.get(
        f"{server.url}/v1/nothing-here", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert_error(response, 404)


COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
INVALID = [
    ("/v1/completions", {**COMPLETION, "temperature": -1}, "temperature"),
    ("/v1/completions", {**COMPLETION, "top_p": 0}, "top_p"),
    ("/v1/completions", {**COMPLETION, "top_p": 1.5}, "top_p"),
    ("/v1/completions", {**COMPLETION, "n": 0}, "n"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {**COMPLETION, "stop": [""]}, "stop"),
    ("/v1/completions", {**COMPLETION, "n": 2, "best_of": 1}, "best_of must be"),
    ("/v1/completions", {**COMPLETION, "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ("/v1/completions", {**COMPLETION, "prompt": []}, "prompt must not be empty"),
    ("/v1/completions", {**COMPLETION, "prompt": [5, 99999]}, "outside the vocabulary"),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": [99999]}, "stop_token_ids"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"99999": 1.0}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "priority": 3}, "not supported"),
    ("/v1/completions", {**COMPLETION, "allowed_token_ids": [99999]}, "allowed_token_ids"),
    ("/v1/completions", {**COMPLETION, "seed": 2**70}, "seed"),
    ("/v1/completions", {**COMPLETION, "stream": True, "best_of": 3}, "streaming"),
    ("/v1/completions", {"model": MODEL, "max_tokens": 4}, "prompt"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, "role"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "not supported"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    # JSON can carry unpaired surrogates, which no tokenizer accepts.
    ("/v1/completions", {**COMPLETION, "prompt": "hi \ud800"}, "unpaired surrogates"),
    ("/v1/completions", {**COMPLETION, "stop": ["\udfff"]}, "unpaired surrogates"),
    ("/v1/completions", {**COMPLETION, "model": "\ud800"}, "unpaired surrogates"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"\ud800": "x"}}, "logit_bias"),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "\ud800"}]},
        "unpaired surrogates",
    ),
    ("/tokenize", {"prompt": "\ud800"}, "unpaired surrogates"),
]


@pytest.mark.parametrize(
    ("path", "body", "fragment"),
    INVALID,
    ids=[f"{p}:{f}:{i}" for i, (p, _, f) in enumerate(INVALID)],
)
def test_invalid_parameters_are_400(
    server: Server, path: str, body: dict[str, Any], fragment: str
) -> None:
    error = assert_error(post(server, path, body), 400, fragment)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "content",
    [b"{not json", b"[1, 2]", b'{"model": "x", "prompt": "a", "temperature": NaN}', b"\xff\xfe"],
)
def test_malformed_bodies_are_400(server: Server, content: bytes) -> None:
    assert_error(post(server, "/v1/completions", content=content), 400)


def test_the_sdk_raises_bad_request_with_the_message(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        server.client().completions.create(model=MODEL, prompt="hi", temperature=-2)
    assert "temperature" in raised.value.body["message"]


def test_prompts_longer_than_max_model_len_are_400_with_the_lengths(server: Server) -> None:
    long_prompt = "word " * 100
    tokens = post(server, "/tokenize", {"prompt": long_prompt}).json()["count"]
    assert_error(
        post(server, "/v1/completions", {**COMPLETION, "prompt": long_prompt}),
        400,
        f"maximum context length is {MAX_MODEL_LEN}",
        f"{tokens} tokens",
    )
    short = post(server, "/tokenize", {"prompt": "hello"}).json()["count"]
    error = assert_error(
        post(server, "/v1/completions", {**COMPLETION, "max_tokens": MAX_MODEL_LEN}),
        400,
        f"{short} in the prompt, {MAX_MODEL_LEN} in the completion",
    )
    assert error["code"] == "context_length_exceeded"
    chat = post(
        server,
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": long_prompt}]},
    )
    assert_error(chat, 400, f"maximum context length is {MAX_MODEL_LEN}")


def test_oversized_bodies_are_413(server: Server) -> None:
    body = b'{"model": "errors-model", "prompt": "' + b"a" * (9 << 20) + b'"}'
    assert_error(post(server, "/v1/completions", content=body), 413)
    # Sent chunked, with no Content-Length, it is refused once it grows past the limit.
    chunked = post(server, "/v1/completions", content=oversized_chunks())
    assert_error(chunked, 413)
    assert chunked.json()["error"]["code"] == "request_too_large"


def test_a_full_queue_answers_503_with_retry_after(server: Server) -> None:
    """One running request (--max-num-seqs 1), one waiting (--max-waiting 1): a third is
    refused; once the first is gone, the waiting one is served."""
    client = server.client()
    for _ in range(3):  # the running request may finish before the scene is set; retry
        running = client.completions.create(
            model=MODEL,
            prompt="hi",
            max_tokens=MAX_MODEL_LEN - 4,
            n=32,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(running))  # it is running once its first chunk is here
        waiting: dict[str, httpx.Response] = {}

        def wait_in_queue(into: dict[str, httpx.Response] = waiting) -> None:
            into["out"] = post(server, "/v1/completions", {**COMPLETION, "max_tokens": 2})

        thread = threading.Thread(target=wait_in_queue)
        thread.start()
        server.wait_until(
            lambda: server.metric("vllm:num_requests_waiting") == 1,
            what="the second request to wait",
        )
        refused = post(server, "/v1/completions", COMPLETION)
        running.close()
        thread.join(60)
        if refused.status_code == 200:
            continue
        error = assert_error(refused, 503, "--max-waiting 1")
        assert error["code"] == "queue_full"
        assert refused.headers["Retry-After"] == "1"
        assert waiting["out"].status_code == 200
        break
    else:
        pytest.fail("the running request always finished before the queue filled")


def test_the_prompts_of_one_request_are_admitted_together(server: Server) -> None:
    """--max-waiting 1, --max-num-seqs 1: an idle node takes a request of three prompts whole
    (its prompts join the first) rather than refusing part of it as busy."""
    for _ in range(3):
        response = post(server, "/v1/completions", {**COMPLETION, "prompt": ["a", "b", "c"]})
        assert response.status_code == 200, response.text
        assert sorted(c["index"] for c in response.json()["choices"]) == [0, 1, 2]


KV_EVENTS = "/v1/kv_events"


def _clamp_cost(body: Any) -> Any:
    """Valid but expensive sample counts are cut down, and batches of prompts to two; invalid
    values stay as generated."""
    if isinstance(body, dict):
        for name in ("n", "best_of"):
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and 4 < value <= 128:
                body[name] = 4
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            body["prompt"] = prompt[:2]
    return body


def test_fuzzed_requests_never_get_a_server_error(server: Server) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers=auth)
    # The KV-events feed takes no input and streams until the node stops, so a call to it
    # never returns (tests/serve/test_serve_kv_events.py covers it).
    operations = [
        result.ok() for result in schema.get_all_operations() if result.ok().path != KV_EVENTS
    ]
    assert len(operations) > 5
    strategies = [
        operation.as_strategy(generation_mode=mode)
        for operation in operations
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
    ]
    seen: dict[int, int] = {}

    @settings(
        max_examples=150,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.one_of(strategies))
    def never_5xx(case: schemathesis.Case) -> None:
        case.body = _clamp_cost(case.body)
        response = case.call(base_url=server.url, headers=auth, timeout=60)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, (case.method, case.path, case.body, response.text)

    never_5xx()
    assert any(status == 200 for status in seen) and any(status == 400 for status in seen)
    assert server.process.poll() is None
    assert server.health() == 200
    out = server.client().completions.create(
        model=MODEL, prompt="still here", max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 2
