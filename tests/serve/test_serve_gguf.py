"""`pagedllm serve --model smollm2`: a real instruct model from a GGUF file, answering through
the official openai client, and the errors a GGUF model path gets before anything starts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from pagedllm.config import resolve_model_dir
from tests.serve.serve_harness import Server, start_server
from tests.serve.test_cli import run

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(
        tmp_path_factory.mktemp("smollm2"),
        "--model",
        "smollm2",
        "--kv-cache-memory",
        "64MiB",
        "--max-model-len",
        "1024",
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
