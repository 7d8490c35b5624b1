"""`pagedllm serve --enable-lora --lora-modules`: adapters named as the model through the
official openai client, answering as the offline engine does, listed with their parent,
counted in the metrics; an unknown model is a 404; an adapter that cannot serve the model
stops the command at start, naming the problem."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pagedllm.llm import LLM
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams
from pagedllm_testing.lora_adapters import demo_adapter
from pagedllm_testing.serve_harness import Server, run, start_server

PROMPT = [1, 17, 300, 42, 9, 250, 77]
TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "sql": demo_adapter(root / "sql", 0, ["q_proj", "v_proj"], 8),
        "poet": demo_adapter(root / "poet", 1, ["o_proj", "gate_proj", "down_proj"], 16),
    }


def lora_server(directory: Path, adapters: dict[str, Path], *flags: str, **kwargs) -> Server:
    """A demo node serving ``adapters`` (name=path and JSON forms) with ``flags``."""
    first, *rest = adapters.items()
    modules = [f"{first[0]}={first[1]}"]
    modules += [json.dumps({"name": name, "path": str(path)}) for name, path in rest]
    return start_server(directory, "--enable-lora", *flags, "--lora-modules", *modules, **kwargs)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, adapters) -> Iterator[Server]:
    running = lora_server(tmp_path_factory.mktemp("lora"), adapters, "--max-loras", "2")
    yield running
    running.stop()


def offline_answers(adapters: dict[str, Path]) -> dict[str | None, tuple[list[int], str]]:
    llm = LLM(enable_lora=True, max_loras=2)
    names: list[str | None] = [None, "sql", "poet"]
    requests = [
        None if n is None else LoRARequest(n, i + 1, str(adapters[n])) for i, n in enumerate(names)
    ]
    outputs = llm.generate(
        [{"prompt_token_ids": PROMPT}] * 3,
        SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
        lora_request=requests,
    )
    return {
        n: (out.outputs[0].token_ids, out.outputs[0].text)
        for n, out in zip(names, outputs, strict=True)
    }


def test_models_lists_the_adapters_with_their_parent(server: Server, adapters) -> None:
    models = {m.id: m for m in server.client().models.list()}
    assert set(models) == {"pagedllm-demo", "sql", "poet"}
    assert models["sql"].parent == models["poet"].parent == "pagedllm-demo"
    assert models["sql"].root == str(adapters["sql"])
    assert models["pagedllm-demo"].parent is None


def test_each_adapter_answers_as_the_offline_engine(server: Server, adapters) -> None:
    expected = offline_answers(adapters)
    assert len({tuple(t) for t, _ in expected.values()}) == 3  # the adapters change the answer
    client = server.client()
    before = {n: server.metric("pagedllm:lora_requests_total", adapter=n) for n in ("sql", "poet")}
    for name in ("pagedllm-demo", "sql", "poet"):
        answer = client.completions.create(
            model=name,
            prompt=PROMPT,
            max_tokens=TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert answer.model == name
        assert answer.usage.completion_tokens == TOKENS
        assert answer.choices[0].text == expected[None if name == "pagedllm-demo" else name][1]
    for name in ("sql", "poet"):
        assert server.metric("pagedllm:lora_requests_total", adapter=name) == before[name] + 1
    info = [k for k in server.metrics() if k.startswith("vllm:lora_requests_info{")]
    assert info and all('max_lora="2"' in k for k in info)


def test_an_unknown_model_is_a_404_naming_what_is_served(server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        server.client().completions.create(model="nope", prompt="hi", max_tokens=2)
    assert caught.value.body["code"] == "model_not_found"
    assert "sql" in caught.value.body["message"] and "poet" in caught.value.body["message"]


def test_a_bad_adapter_stops_the_command_at_start(tmp_path: Path, adapters) -> None:
    result = run(
        "serve",
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"poet={adapters['poet']}",
    )
    assert result.returncode == 2
    assert "--lora-modules poet: the adapter's rank 16 is above --max-lora-rank 8" in result.stderr
    result = run("serve", "--lora-modules", f"sql={adapters['sql']}")
    assert result.returncode == 2 and "--lora-modules needs --enable-lora" in result.stderr
    result = run("serve", "--enable-lora", "--lora-modules", f"x={tmp_path}")
    assert result.returncode == 2 and "no adapter_config.json" in result.stderr


@pytest.fixture(scope="module")
def updating(tmp_path_factory: pytest.TempPathFactory, adapters) -> Iterator[Server]:
    running = lora_server(
        tmp_path_factory.mktemp("lora-updating"),
        {"sql": adapters["sql"]},
        "--allow-runtime-lora-updating",
        "--api-server-count",
        "2",
        api_key="secret",
    )
    yield running
    running.stop()


def test_adapters_load_and_unload_at_runtime(updating: Server, adapters, tmp_path) -> None:
    client = updating.client()
    answers = offline_answers(adapters)
    post = updating.client().post
    # Loaded: every API server (two here) lists it and serves it at once.
    loaded = post(
        "/load_lora_adapter",
        body={"lora_name": "poet", "lora_path": str(adapters["poet"])},
        cast_to=str,
    )
    assert loaded == "Success: LoRA adapter 'poet' added successfully."
    for _ in range(4):  # the connections land on both API servers
        fresh = updating.client()
        assert "poet" in {m.id for m in fresh.models.list()}
        answer = fresh.completions.create(
            model="poet", prompt=PROMPT, max_tokens=TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert answer.choices[0].text == answers["poet"][1]
    # A second load of the name, an adapter that cannot serve the model: 400s naming why.
    with pytest.raises(openai.BadRequestError, match="already been loaded"):
        post("/load_lora_adapter", body={"lora_name": "poet", "lora_path": "/x"}, cast_to=str)
    with pytest.raises(openai.BadRequestError, match="no adapter_config.json"):
        post("/load_lora_adapter", body={"lora_name": "x", "lora_path": str(tmp_path)}, cast_to=str)
    # Unloaded: gone from the list, a 404 to request; unloading it again is a 404 too.
    unloaded = post("/unload_lora_adapter", body={"lora_name": "poet"}, cast_to=str)
    assert unloaded == "Success: LoRA adapter 'poet' removed successfully."
    assert "poet" not in {m.id for m in client.models.list()}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="poet", prompt="hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="cannot be found"):
        post("/unload_lora_adapter", body={"lora_name": "poet"}, cast_to=str)
    # The endpoints need the API key like every other.
    with pytest.raises(openai.AuthenticationError):
        updating.client(api_key="wrong").post(
            "/unload_lora_adapter", body={"lora_name": "sql"}, cast_to=str
        )


def test_the_update_endpoints_are_off_unless_turned_on(server: Server) -> None:
    with pytest.raises(openai.NotFoundError):
        server.client().post(
            "/load_lora_adapter", body={"lora_name": "a", "lora_path": "/a"}, cast_to=str
        )
