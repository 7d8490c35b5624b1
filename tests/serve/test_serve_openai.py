"""The real `pagedllm serve` (two API servers on one port) driven by the official openai SDK."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm_testing.serve_harness import DEMO_MODEL, Server, start_server

GREEDY = {"temperature": 0.0}
# Unique first words: no prompt here shares a KV block with another, so the offline engine and
# the server run the same computation (a prefix hit would change the floating-point path).
PROMPTS = ["Once upon a time", "The capital of France is"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(tmp_path_factory.mktemp("openai"), "--api-server-count", "2")
    yield running
    running.stop()


def test_greedy_completions_equal_the_offline_api(server: Server, offline: LLM) -> None:
    client = server.client()
    for prompt in PROMPTS:
        got = client.completions.create(model=DEMO_MODEL, prompt=prompt, max_tokens=12, **GREEDY)
        (want,) = offline.generate(
            [prompt], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False
        )
        assert got.choices[0].text == want.outputs[0].text
        assert got.choices[0].finish_reason == want.outputs[0].finish_reason
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
        assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_greedy_chat_equals_the_offline_api(server: Server, offline: LLM) -> None:
    messages = [{"role": "user", "content": "Tell me about ships"}]
    got = server.client().chat.completions.create(
        model=DEMO_MODEL, messages=messages, max_completion_tokens=10, **GREEDY
    )
    (want,) = offline.chat(messages, SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)
    assert got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)


def test_streamed_completion_matches_the_whole_one(server: Server) -> None:
    client = server.client()
    args = {"model": DEMO_MODEL, "prompt": "Rivers flow", "max_tokens": 10, **GREEDY}
    whole = client.completions.create(**args)
    chunks = list(
        client.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_streamed_chat_matches_the_whole_one(server: Server) -> None:
    client = server.client()
    args = {
        "model": DEMO_MODEL,
        "messages": [{"role": "user", "content": "Weather today"}],
        "max_tokens": 10,
        **GREEDY,
    }
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_n_samples_are_distinct_choices_and_seeded_ones_repeat(server: Server) -> None:
    client = server.client()
    args = {
        "model": DEMO_MODEL,
        "prompt": "Green fields",
        "n": 3,
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 7,
        "extra_body": {"ignore_eos": True},
    }
    first = client.completions.create(**args)
    again = client.completions.create(**args)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert first.usage.completion_tokens == 3 * 8
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    streamed = list(client.completions.create(**args, stream=True))
    by_index: dict[int, str] = {}
    for chunk in streamed:
        for choice in chunk.choices:
            by_index[choice.index] = by_index.get(choice.index, "") + choice.text
    assert by_index == {c.index: c.text for c in first.choices}

    chat = client.chat.completions.create(
        model=DEMO_MODEL,
        messages=[{"role": "user", "content": "Pick colors"}],
        n=2,
        max_tokens=5,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.usage.completion_tokens == 10


def test_best_of_returns_n_choices(server: Server) -> None:
    out = server.client().completions.create(
        model=DEMO_MODEL,
        prompt="Mountains rise",
        n=2,
        best_of=4,
        max_tokens=4,
        seed=1,
    )
    assert sorted(c.index for c in out.choices) == [0, 1]


def test_stop_strings_end_the_text_before_them(server: Server) -> None:
    client = server.client()
    args = {
        "model": DEMO_MODEL,
        "prompt": "Bright stars",
        "max_tokens": 16,
        **GREEDY,
        "extra_body": {"ignore_eos": True},
    }
    full = client.completions.create(**args).choices[0].text
    stop = full[6:9]
    assert stop.strip(), f"the greedy text is too blank to pick a stop string: {full!r}"
    expected = full[: full.find(stop)]

    stopped = client.completions.create(**args, stop=[stop])
    assert stopped.choices[0].text == expected
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["stop_reason"] == stop

    chunks = list(client.completions.create(**args, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"

    kept = client.completions.create(
        **{**args, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}},
        stop=[stop],
    )
    assert kept.choices[0].text == expected + stop


def test_stop_token_ids_end_generation_at_that_token(server: Server, offline: LLM) -> None:
    prompt = "Quiet rooms"
    (full,) = offline.generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False
    )
    tokens = full.outputs[0].token_ids
    stop_id = tokens[3]
    out = server.client().completions.create(
        model=DEMO_MODEL,
        prompt=prompt,
        max_tokens=12,
        **GREEDY,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]},
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop_id
    assert out.usage.completion_tokens == tokens.index(stop_id) + 1


def test_completion_logprobs(server: Server) -> None:
    out = server.client().completions.create(
        model=DEMO_MODEL,
        prompt="Old castles",
        max_tokens=6,
        logprobs=3,
        **GREEDY,
        extra_body={"ignore_eos": True},
    )
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    assert "".join(logprobs.tokens) == out.choices[0].text
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert 3 <= len(top) <= 4
        assert chosen <= 0.0
        # Greedy picks the most likely token.
        assert chosen == pytest.approx(max(top.values()))
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_chat_logprobs(server: Server) -> None:
    out = server.client().chat.completions.create(
        model=DEMO_MODEL,
        messages=[{"role": "user", "content": "Count sheep"}],
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(c.token for c in content) == out.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes) == entry.token.encode()


def test_echo_returns_the_prompt_and_its_logprobs(server: Server) -> None:
    prompt = "Silver moon"
    client = server.client()
    out = client.completions.create(
        model=DEMO_MODEL,
        prompt=prompt,
        max_tokens=3,
        echo=True,
        logprobs=1,
        **GREEDY,
        extra_body={"ignore_eos": True},
    )
    choice = out.choices[0]
    assert choice.text.startswith(prompt)
    prompt_len = out.usage.prompt_tokens
    assert len(choice.logprobs.tokens) == prompt_len + 3
    assert choice.logprobs.token_logprobs[0] is None
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs[1:])

    chunks = list(
        client.completions.create(
            model=DEMO_MODEL,
            prompt=prompt,
            max_tokens=3,
            echo=True,
            logprobs=1,
            stream=True,
            **GREEDY,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    streamed = [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == choice.logprobs.token_logprobs
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert offsets == choice.logprobs.text_offset


def test_token_id_prompts_and_prompt_lists(server: Server) -> None:
    client = server.client()
    text_prompt = "Deep oceans"
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": text_prompt}).json()["tokens"]
    by_text = client.completions.create(
        model=DEMO_MODEL, prompt=text_prompt, max_tokens=6, **GREEDY
    )
    by_ids = client.completions.create(model=DEMO_MODEL, prompt=ids, max_tokens=6, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text

    several = client.completions.create(
        model=DEMO_MODEL, prompt=[ids, ids[:2]], n=2, max_tokens=3, seed=5
    )
    assert sorted(c.index for c in several.choices) == [0, 1, 2, 3]
    assert several.usage.prompt_tokens == len(ids) + 2


def test_models_version_tokenize_detokenize(server: Server) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [DEMO_MODEL]
    assert models.data[0].model_extra["max_model_len"] == 2048
    assert httpx.get(f"{server.url}/version").json()["version"]
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 2048
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"][1:]}).json()
    assert text["prompt"] == "hello world"
    chat = httpx.post(
        f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
    ).json()
    assert chat["count"] > 3


VLLM_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_count",
)


def test_metrics_count_every_request_across_api_servers(server: Server) -> None:
    names = {key.split("{", 1)[0] for key in server.metrics()}
    assert set(VLLM_METRICS) <= names
    labels = {"model_name": DEMO_MODEL}
    before = server.metrics()
    count, max_tokens = 10, 5
    prompt_tokens = 0
    for i in range(count):
        # A fresh connection each time, so the kernel spreads them over both API servers.
        response = httpx.post(
            f"{server.url}/v1/completions",
            json={
                "model": DEMO_MODEL,
                "prompt": f"Metric sample {i}",
                "max_tokens": max_tokens,
                "ignore_eos": True,
            },
            timeout=60,
        )
        assert response.status_code == 200
        prompt_tokens += response.json()["usage"]["prompt_tokens"]

    def grew(name: str, **extra: str) -> float:
        return server.metric(name, **labels, **extra) - sum(
            v
            for k, v in before.items()
            if k.split("{", 1)[0] == name
            and all(f'{a}="{b}"' in k for a, b in {**labels, **extra}.items())
        )

    server.wait_until(
        lambda: grew("vllm:generation_tokens_total") == count * max_tokens,
        what="generation tokens to be counted",
    )
    assert grew("vllm:prompt_tokens_total") == prompt_tokens
    assert grew("vllm:request_success_total", finished_reason="length") == count
    for histogram in (
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
    ):
        assert grew(f"{histogram}_count") == count, histogram
    assert grew("vllm:inter_token_latency_seconds_count") == count * (max_tokens - 1)
    server.wait_until(
        lambda: server.metric("vllm:num_requests_running") == 0, what="no running requests"
    )
    assert server.metric("vllm:num_requests_waiting") == 0
    assert server.metric("vllm:kv_cache_usage_perc") == 0.0


def test_prefix_cache_hits_are_counted(server: Server) -> None:
    shared = "A long shared system prompt about lighthouses and the sea " * 3
    client = server.client()
    before = server.metric("vllm:prefix_cache_hits_total")
    for suffix in ("first", "second"):
        client.completions.create(model=DEMO_MODEL, prompt=shared + suffix, max_tokens=2)
    server.wait_until(
        lambda: server.metric("vllm:prefix_cache_hits_total") >= before + 16,
        what="a prefix-cache hit",
    )
    server.wait_until(
        lambda: server.metric("vllm:kv_cache_usage_perc") == 0.0,
        what="cached blocks to count as free",
    )
