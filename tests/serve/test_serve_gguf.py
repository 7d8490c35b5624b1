"""`pagedllm serve --model smollm2`: a real instruct model from a GGUF file, answering through
the official openai client, and the errors a GGUF model path gets before anything starts."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from pagedllm.config import resolve_model_dir
from pagedllm_testing.serve_harness import Server, run, start_server

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PLANETS = {"Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # The float32 path (the file's weights de-quantized), whose answers these tests know: kept
    # quantized, the rows' int8 rounding flips this question's first token (to "L'Étoile...",
    # as llama.cpp's server answers from the same file); that path's own test is below.
    running = start_server(
        tmp_path_factory.mktemp("smollm2"),
        "--model",
        "smollm2",
        "--quantization",
        "none",
        "--kv-cache-memory",
        "64MiB",
        "--max-model-len",
        "1024",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    )
    yield running
    running.stop()


def test_the_model_answers_a_chat_question(server: Server) -> None:
    client = server.client()
    assert [model.id for model in client.models.list()] == ["smollm2"]
    answer = client.chat.completions.create(
        model="smollm2", messages=QUESTION, max_completion_tokens=32, temperature=0
    )
    choice = answer.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"  # <|im_end|> ended the turn, not the token limit
    assert answer.usage.completion_tokens < 32


def test_a_streamed_answer_is_the_same_text(server: Server) -> None:
    client = server.client()
    whole = client.chat.completions.create(
        model="smollm2", messages=QUESTION, max_completion_tokens=32, temperature=0
    )
    pieces = [
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model="smollm2",
            messages=QUESTION,
            max_completion_tokens=32,
            temperature=0,
            stream=True,
        )
        if chunk.choices
    ]
    assert "".join(pieces) == whole.choices[0].message.content


def test_structured_output_follows_its_schema(server: Server) -> None:
    """The grammar is compiled on the tokenizer the GGUF file holds (in the scheduler) and
    followed on it (in the worker): the answer is JSON of the schema."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"enum": ["FR"]}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    answer = server.client().chat.completions.create(
        model="smollm2",
        messages=QUESTION,
        max_completion_tokens=64,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "place", "schema": schema, "strict": True},
        },
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    place = json.loads(choice.message.content)
    jsonschema.validate(place, schema)


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "The city's name"}},
    "required": ["city"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {
        "timezone": {"type": "string", "description": "An IANA time zone, e.g. Europe/Paris"}
    },
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Get the current time in a time zone",
            "parameters": TIME,
        },
    },
]
WEATHER_QUESTION = [{"role": "user", "content": "What's the weather in Paris?"}]


def _weather_call(server: Server) -> tuple[object, object]:
    """SmolLM2 asked about the weather with tool_choice "required" (through its own chat
    format, ChatML, with the built-in tool template listing the tools)."""
    answer = server.client(timeout=600).chat.completions.create(
        model="smollm2",
        messages=WEATHER_QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_completion_tokens=64,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    return choice.message, call


def test_a_required_tool_call_names_the_right_function(server: Server) -> None:
    _, call = _weather_call(server)
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER)
    assert "paris" in arguments["city"].lower()


def test_a_two_turn_tool_conversation(server: Server) -> None:
    """Call, the tool's result, the answer: the second turn renders the assistant's call and
    the tool message through the template, and the model answers from the result."""
    message, call = _weather_call(server)
    conversation = [
        *WEATHER_QUESTION,
        message.model_dump(exclude_none=True),
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": json.dumps({"city": "Paris", "temperature_c": 21, "sky": "sunny"}),
        },
    ]
    answer = server.client(timeout=600).chat.completions.create(
        model="smollm2",
        messages=conversation,
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_completion_tokens=64,
    )
    choice = answer.choices[0]
    assert choice.message.tool_calls is None
    assert choice.finish_reason == "stop"
    assert "21" in choice.message.content or "sunny" in choice.message.content.lower()


def test_served_with_its_weights_kept_quantized(tmp_path: Path) -> None:
    quantized = start_server(
        tmp_path, "--model", "smollm2", "--kv-cache-memory", "64MiB", "--max-model-len", "1024"
    )
    try:
        answer = quantized.client().chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Name the planets of the solar system."}],
            max_completion_tokens=96,
            temperature=0,
        )
        # The quantized path's greedy text is its own (rows rounded to int8 in the kernel, the
        # prompt's rows to bfloat16 in the GEMM path), so the check is what it says, not its
        # exact words; it may describe each planet at length, hence the room.
        text = answer.choices[0].message.content
        assert len(PLANETS & set(re.findall(r"[A-Za-z]+", text))) >= 3, text
    finally:
        quantized.stop()


def test_serve_asks_which_file_of_several(tmp_path: Path) -> None:
    smollm2 = Path(resolve_model_dir("smollm2"))
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).symlink_to(smollm2)
    result = run("serve", "--model", str(tmp_path))
    assert result.returncode == 2
    assert "holds 2 GGUF files (a.gguf, b.gguf); pass the one to serve" in result.stderr


def test_serve_names_an_unreadable_file(tmp_path: Path) -> None:
    broken = tmp_path / "model.gguf"
    with Path(resolve_model_dir("smollm2")).open("rb") as source:
        broken.write_bytes(source.read(4096))  # the header, cut inside the vocabulary
    result = run("serve", "--model", str(broken))
    assert result.returncode == 2
    assert f"cannot read GGUF file {broken}" in result.stderr
