"""Tool calling through the real `pagedllm serve` (demo model, built-in Hermes-style tool
template, hermes parser), driven by the official openai SDK; streams are put together by the
SDK's own accumulator and must equal the whole answers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from pagedllm_testing.openai_stream import Accumulated, accumulate
from pagedllm_testing.serve_harness import DEMO_MODEL, Server, start_server

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


def _whole_and_streamed(server: Server, **args: object) -> tuple[Any, Accumulated]:
    """The same request (seeded) answered whole and streamed, the stream put together by the
    SDK's own accumulator."""
    client = server.client()
    whole = client.chat.completions.create(model=DEMO_MODEL, messages=QUESTION, **args)
    chunks = client.chat.completions.create(
        model=DEMO_MODEL, messages=QUESTION, stream=True, **args
    )
    return whole, accumulate(chunks)


def _check_streamed_like_whole(whole: Any, streamed: Accumulated) -> list:
    """The streamed calls equal the whole reply's, each opened by one delta with its id,
    type and name and then written in argument pieces."""
    expected = whole.choices[0].message
    got = streamed.completion.choices[0]
    assert got.finish_reason == whole.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in expected.tool_calls
    ]
    opening = [d for d in streamed.call_deltas[0] if d.id is not None]
    assert [d.index for d in opening] == list(range(len(expected.tool_calls)))
    assert all(d.type == "function" and d.function.arguments == "" for d in opening)
    # Incremental: the arguments of each call come in more than one piece.
    for index, call in enumerate(expected.tool_calls):
        pieces = streamed.argument_pieces[index]
        assert "".join(pieces) == call.function.arguments
        assert len(pieces) > 1, pieces
    _check_calls(got.message.tool_calls)
    return got.message.tool_calls


def test_named_function_whole_and_streamed(server: Server) -> None:
    whole, streamed = _whole_and_streamed(
        server,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_completion_tokens=200,
        seed=2,
    )
    (call,) = _check_streamed_like_whole(whole, streamed)
    assert call.function.name == "get_time"


def test_required_streamed_parallel_calls(server: Server) -> None:
    """Parallel calls stream one after another with increasing indexes."""
    for seed in range(20):
        whole, streamed = _whole_and_streamed(
            server, tools=TOOLS, tool_choice="required", max_completion_tokens=400, seed=seed
        )
        calls = _check_streamed_like_whole(whole, streamed)
        if len(calls) > 1:
            return
    pytest.fail("no seed in 20 gave parallel calls")


# Makes the demo model (which knows nothing of tools) write text and then a Hermes call, so
# that "auto" reads a real model output with the hermes parser.
HERMES_REPLY = (
    r'Let me see\.\n<tool_call>\n\{"name": "get_time", "arguments": '
    r'\{"zone": "[A-Z]{3,6}"\}\}\n</tool_call>'
)


def test_auto_streams_content_then_calls(server: Server) -> None:
    whole, streamed = _whole_and_streamed(
        server,
        tools=TOOLS,
        max_completion_tokens=200,
        seed=4,
        extra_body={"structured_outputs": {"regex": HERMES_REPLY}},
    )
    (call,) = _check_streamed_like_whole(whole, streamed)
    assert call.function.name == "get_time"
    assert whole.choices[0].message.content == "Let me see."
    assert streamed.completion.choices[0].message.content.startswith("Let me see.")


def test_auto_without_a_call_streams_content(server: Server) -> None:
    whole, streamed = _whole_and_streamed(server, tools=TOOLS, max_completion_tokens=16, seed=3)
    assert whole.choices[0].message.tool_calls is None
    assert streamed.completion.choices[0].message.content == whole.choices[0].message.content
    assert streamed.completion.choices[0].finish_reason == whole.choices[0].finish_reason


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
