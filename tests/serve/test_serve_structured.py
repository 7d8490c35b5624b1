"""Structured outputs through the real `pagedllm serve`, driven by the official openai SDK."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from pydantic import BaseModel, Field

from pagedllm_testing.serve_harness import DEMO_MODEL, Server, start_server
from pagedllm_testing.strategies import json_schemas, regexes

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON"}]


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(tmp_path_factory.mktemp("structured"))
    yield running
    running.stop()


def test_parse_with_a_pydantic_model(server: Server) -> None:
    completion = server.client().chat.completions.parse(
        model=DEMO_MODEL,
        messages=MESSAGES,
        response_format=Person,
        max_completion_tokens=200,
        seed=1,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Person)
    assert message.parsed == Person.model_validate_json(message.content)


def _json_schema_format(schema: dict) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": schema, "strict": True},
    }


def test_json_schema_strict_whole_and_streamed(server: Server) -> None:
    client = server.client()
    args = {
        "model": DEMO_MODEL,
        "messages": MESSAGES,
        "response_format": _json_schema_format(PERSON_SCHEMA),
        "max_completion_tokens": 200,
        "n": 3,
        "seed": 7,
    }
    whole = client.chat.completions.create(**args)
    streamed: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    outputs = [(c.message.content, c.finish_reason) for c in whole.choices]
    outputs += [(streamed[i], finish[i]) for i in sorted(streamed)]
    assert len(outputs) == 6
    finished = [text for text, reason in outputs if reason == "stop"]
    assert len(finished) >= 4, outputs
    for text in finished:
        jsonschema.validate(json.loads(text), PERSON_SCHEMA)


def test_json_object(server: Server) -> None:
    reply = server.client().chat.completions.create(
        model=DEMO_MODEL,
        messages=MESSAGES,
        response_format={"type": "json_object"},
        max_completion_tokens=200,
        temperature=0,
    )
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:  # greedy on random weights may nest forever; what it wrote is still JSON's start
        assert reply.choices[0].message.content.lstrip().startswith("{")


def test_completions_regex_and_choice_through_extra_body(server: Server) -> None:
    client = server.client()
    pattern = r"[a-z]{3,6}@example\.(com|org)"
    regex = client.completions.create(
        model=DEMO_MODEL,
        prompt="An email address:",
        max_tokens=40,
        n=4,
        seed=3,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    for choice in regex.choices:
        assert choice.finish_reason == "stop"
        assert re.fullmatch(pattern, choice.text), choice.text
    choices = ["yes", "no", "maybe so"]
    answers = client.completions.create(
        model=DEMO_MODEL,
        prompt="Is it raining?",
        max_tokens=10,
        n=8,
        seed=4,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert {c.text for c in answers.choices} <= set(choices)
    # The older name, streamed.
    chunks = client.completions.create(
        model=DEMO_MODEL,
        prompt="Is it raining?",
        max_tokens=10,
        stream=True,
        extra_body={"guided_choice": choices},
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) in choices


def test_a_grammar_that_cannot_compile_is_a_400_naming_the_problem(server: Server) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model=DEMO_MODEL,
            prompt="x",
            max_tokens=5,
            extra_body={"structured_outputs": {"regex": "(ab"}},
        )
    assert "structured_outputs.regex" in caught.value.message
    assert "parenthesis" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=DEMO_MODEL,
            messages=MESSAGES,
            stream=True,
            response_format=_json_schema_format({"type": "no-such-type"}),
        )
    assert "no-such-type" in caught.value.message
    # The node goes on serving.
    ok = client.completions.create(model=DEMO_MODEL, prompt="x", max_tokens=2)
    assert ok.choices[0].text is not None


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a"}, "ignore_eos": True}, "ignore_eos"),
    ],
)
def test_malformed_constraints_are_400s(server: Server, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().completions.create(
            model=DEMO_MODEL, prompt="x", max_tokens=5, extra_body=extra
        )
    assert caught.value.body["param"] == param, caught.value.body


def test_fields_that_change_nothing_are_accepted(server: Server) -> None:
    reply = server.client().chat.completions.create(
        model=DEMO_MODEL,
        messages=MESSAGES,
        max_completion_tokens=3,
        user="someone",
        metadata={"team": "a"},
        store=False,
    )
    assert reply.choices[0].message.content is not None


@pytest.mark.parametrize(
    "extra",
    [{"priority": 1}, {"return_tokens_as_token_ids": True}, {"prompt_logprobs": 2}],
)
def test_fields_not_implemented_are_400s_naming_them(server: Server, extra: dict) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(
            model=DEMO_MODEL, messages=MESSAGES, max_completion_tokens=3, extra_body=extra
        )
    (name,) = extra
    assert caught.value.body["param"] == name
    assert name in caught.value.message


def test_chat_template_kwargs_and_continue_final_message(server: Server) -> None:
    client = server.client()
    prefix = [*MESSAGES, {"role": "assistant", "content": "Sure:"}]
    cont = client.chat.completions.create(
        model=DEMO_MODEL,
        messages=prefix,
        max_completion_tokens=2,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    fresh = client.chat.completions.create(
        model=DEMO_MODEL, messages=MESSAGES, max_completion_tokens=2
    )
    # Continued: the assistant's words end the prompt, with no end-of-turn after them.
    assert cont.usage.prompt_tokens > fresh.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError):  # a variable the template call cannot take
        client.chat.completions.create(
            model=DEMO_MODEL,
            messages=MESSAGES,
            max_completion_tokens=2,
            extra_body={"chat_template_kwargs": {"tokenize": True}},
        )


@settings(
    max_examples=3,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schema=json_schemas(), pattern=regexes())
def test_streamed_outputs_follow_drawn_constraints(
    server: Server, schema: dict, pattern: str
) -> None:
    """The property of tests/structured, a smaller sample through the server and streaming."""
    client = server.client()
    for constraint, check in (
        (
            {"json": schema, "disable_any_whitespace": True},
            lambda t: jsonschema.validate(json.loads(t), schema),
        ),
        (
            {"regex": pattern},
            lambda t: re.fullmatch(pattern, t) or pytest.fail(f"{pattern!r} {t!r}"),
        ),
    ):
        texts: dict[int, str] = {}
        finish: dict[int, str] = {}
        for chunk in client.completions.create(
            model=DEMO_MODEL,
            prompt="Write it:",
            max_tokens=150,
            n=2,
            stream=True,
            extra_body={"structured_outputs": constraint},
        ):
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
                if choice.finish_reason is not None:
                    finish[choice.index] = choice.finish_reason
        finished = [texts[i] for i, reason in finish.items() if reason == "stop"]
        assert finished, (constraint, texts)
        for text in finished:
            check(text)
