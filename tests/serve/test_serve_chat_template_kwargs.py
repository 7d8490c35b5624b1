"""``chat_template_kwargs`` follows vLLM's rule, checked through the openai SDK on a real node.

vLLM refuses ``chat_template`` and ``tokenize`` in it, passes on the keys the template reads or
that ``apply_chat_template`` takes by name, and drops the rest; the request's top-level
``add_generation_prompt`` and ``continue_final_message`` win over the kwargs, defaults included.
The node serves a template that writes each variable it reads visibly, and each rendering is
compared with the text the rule gives, tokenized by the same node.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from pagedllm_testing.serve_harness import DEMO_MODEL, Server, start_server

TEMPLATE = (
    "{%- if documents %}[docs:{% for d in documents %}{{ d.title }};{% endfor %}]{% endif -%}"
    "{%- for m in messages %}[{{ m.role }}] {{ m.content }}<end>{% endfor -%}"
    "{%- if add_generation_prompt %}[assistant]"
    "{%- if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
    "{%- endif -%}"
    "{%- if note is defined %}({{ note }}){% endif -%}"
)
MESSAGES = [{"role": "user", "content": "Hi"}]
REPLY = [*MESSAGES, {"role": "assistant", "content": "Sure"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(tmp_path_factory.mktemp("kwargs"), "--chat-template", TEMPLATE)
    yield running
    running.stop()


def text_tokens(server: Server, text: str) -> list[int]:
    answer = httpx.post(
        f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30
    )
    assert answer.status_code == 200, answer.text
    tokens: list[int] = answer.json()["tokens"]
    return tokens


def chat_tokens(server: Server, messages: list[dict[str, str]], **fields: Any) -> list[int]:
    answer = httpx.post(f"{server.url}/tokenize", json={"messages": messages, **fields}, timeout=30)
    assert answer.status_code == 200, answer.text
    tokens: list[int] = answer.json()["tokens"]
    return tokens


# (top-level fields, chat_template_kwargs, the prompt vLLM's rule renders)
CASES = [
    # The top-level field wins, its default included: a generation prompt is added.
    ({}, {"add_generation_prompt": False}, "[user] Hi<end>[assistant]"),
    ({"add_generation_prompt": False}, {"add_generation_prompt": True}, "[user] Hi<end>"),
    # Not continued: the top-level default (False) wins over the kwargs.
    (
        {"add_generation_prompt": False},
        {"continue_final_message": True},
        "[user] Hi<end>[assistant] Sure<end>",
    ),
    # A variable the template reads.
    ({}, {"enable_thinking": False}, "[user] Hi<end>[assistant]<no-think>"),
    ({}, {"note": "terse"}, "[user] Hi<end>[assistant](terse)"),
    # A parameter of apply_chat_template.
    ({}, {"documents": [{"title": "a"}, {"title": "b"}]}, "[docs:a;b;][user] Hi<end>[assistant]"),
    # Neither: dropped, and so are the tools (the request's own field sets them).
    ({}, {"not_read_anywhere": 1, "tools": []}, "[user] Hi<end>[assistant]"),
]


@pytest.mark.parametrize(("fields", "kwargs", "rendered"), CASES)
def test_each_key_renders_as_vllms_rule_gives(
    server: Server, fields: dict[str, Any], kwargs: dict[str, Any], rendered: str
) -> None:
    messages = REPLY if "continue_final_message" in kwargs else MESSAGES
    expected = text_tokens(server, rendered)
    body = {**fields, "chat_template_kwargs": kwargs}
    assert chat_tokens(server, messages, **body) == expected
    completion = server.client().chat.completions.create(
        model=DEMO_MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_completion_tokens=1,
        extra_body=body,
    )
    assert completion.usage is not None and completion.usage.prompt_tokens == len(expected)


def test_continue_final_message_at_the_top_level_continues(server: Server) -> None:
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    assert chat_tokens(server, REPLY, **fields) == text_tokens(
        server, "[user] Hi<end>[assistant] Sure"
    )


@pytest.mark.parametrize("key", ["chat_template", "tokenize"])
def test_chat_template_and_tokenize_are_refused_naming_the_key(server: Server, key: str) -> None:
    kwargs = {key: "{{ messages }}" if key == "chat_template" else True}
    with pytest.raises(openai.BadRequestError) as refused:
        server.client().chat.completions.create(
            model=DEMO_MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_completion_tokens=1,
            extra_body={"chat_template_kwargs": kwargs},
        )
    assert refused.value.body["param"] == "chat_template_kwargs"
    assert key in refused.value.message
    answer = httpx.post(
        f"{server.url}/tokenize",
        json={"messages": MESSAGES, "chat_template_kwargs": kwargs},
        timeout=30,
    )
    assert answer.status_code == 400 and key in answer.json()["error"]["message"]
