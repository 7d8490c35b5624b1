"""Tool calling through the real `pagedllm serve` (demo model, built-in Hermes-style tool
template, hermes parser), driven by the official openai SDK."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from tests.serve.serve_harness import DEMO_MODEL, Server, start_server

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 6}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Time in a zone",
            "parameters": TIME,
            "strict": True,
        },
    },
]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(
        tmp_path_factory.mktemp("tools"),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    )
    yield running
    running.stop()


def _check_calls(calls: list) -> None:
    assert calls
    for call in calls:
        assert call.type == "function"
        assert call.id
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_required_always_calls_a_tool(server: Server) -> None:
    reply = server.client().chat.completions.create(
        model=DEMO_MODEL,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_completion_tokens=300,
        n=3,
        seed=5,
    )
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls)


def test_named_function_whole_and_streamed(server: Server) -> None:
    client = server.client()
    args = {
        "model": DEMO_MODEL,
        "messages": QUESTION,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "max_completion_tokens": 200,
        "seed": 2,
    }
    reply = client.chat.completions.create(**args)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert reply.choices[0].finish_reason == "tool_calls"
    _check_calls([call])
    streamed: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                entry = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert [e["name"] for e in streamed.values()] == ["get_time"]
    assert json.loads(streamed[0]["arguments"]) == json.loads(call.function.arguments)


def test_auto_renders_the_tools_and_answers_in_either_shape(server: Server) -> None:
    client = server.client()
    plain = client.chat.completions.create(
        model=DEMO_MODEL, messages=QUESTION, max_completion_tokens=8
    )
    reply = client.chat.completions.create(
        model=DEMO_MODEL, messages=QUESTION, tools=TOOLS, max_completion_tokens=8, temperature=0
    )
    # The tools are in the prompt (the built-in tool template lists them).
    assert reply.usage.prompt_tokens > plain.usage.prompt_tokens + 50
    message = reply.choices[0].message
    assert message.content is not None or message.tool_calls


def test_two_turn_tool_conversation(server: Server) -> None:
    client = server.client()
    first = client.chat.completions.create(
        model=DEMO_MODEL,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_completion_tokens=200,
        seed=9,
    )
    call = first.choices[0].message.tool_calls[0]
    conversation = [
        *QUESTION,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    second = client.chat.completions.create(
        model=DEMO_MODEL,
        messages=conversation,
        tools=TOOLS,
        tool_choice="none",
        max_completion_tokens=12,
    )
    assert second.choices[0].message.tool_calls is None
    assert isinstance(second.choices[0].message.content, str)
    assert second.choices[0].finish_reason in ("stop", "length")
    # The call and the tool's answer are in the second prompt.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.parametrize(
    "extra",
    [
        {"tool_choice": "required"},  # no tools
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
    ],
)
def test_tool_choices_that_cannot_be_served_are_400s(server: Server, extra: dict) -> None:
    with pytest.raises(openai.BadRequestError):
        server.client().chat.completions.create(model=DEMO_MODEL, messages=QUESTION, **extra)
