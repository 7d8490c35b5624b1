"""Streamed tool calls (OpenAI's incremental ``delta.tool_calls``): a reply fed in pieces, put
together by the openai SDK's own stream accumulator, gives the calls and content that the
whole (non-streamed) reply has, for each parser and each forced-call mode."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.api.tool_call_stream import ToolCallStream, stable_arguments
from pagedllm.api.tool_calls import ToolPlan
from pagedllm.api.tool_parsers import PARSERS
from pagedllm_testing.openai_stream import Accumulated, accumulate

ARGS = {"city": 'Zürich "old" town', "days": [1, 2.5, -30], "metric": True, "note": None}
ARGS_TEXT = json.dumps(ARGS)
MORE = {"zone": "UTC+1 😀 \\ end"}
MORE_TEXT = json.dumps(MORE)


def _plan(mode: str) -> ToolPlan:
    if mode == "named":
        return ToolPlan("named", [], name="get_weather")
    if mode == "required":
        return ToolPlan("required", [])
    return ToolPlan("auto", [], parser=PARSERS[mode])


def _chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }


def _stream(plan: ToolPlan, pieces: list[str]) -> Accumulated:
    """The chunks the server sends for a reply arriving in ``pieces``, through the SDK."""
    stream = ToolCallStream(plan)
    chunks = [_chunk({"role": "assistant", "content": ""})]
    for piece in pieces:
        chunks += [_chunk(d) for d in stream.feed(piece)]
    deltas, finish_reason = stream.finish("stop")
    chunks += [_chunk(d) for d in deltas] + [_chunk({}, finish_reason)]
    return accumulate(chunks)


def _check_same_as_whole(plan: ToolPlan, pieces: list[str]) -> Accumulated:
    text = "".join(pieces)
    whole = plan.read(text)
    got = _stream(plan, pieces)
    message = got.completion.choices[0].message
    streamed = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert streamed == [(c.name, c.arguments) for c in whole.calls]
    if whole.calls:
        assert got.completion.choices[0].finish_reason == "tool_calls"
        assert (message.content or "").strip() == (whole.content or "")
        # Each call opens with index, id, type, name and empty arguments; then only pieces.
        opened: set[int] = set()
        for delta in got.call_deltas[0]:
            if delta.index not in opened:
                assert delta.id and delta.type == "function" and delta.function.name
                assert delta.function.arguments == ""
                opened.add(delta.index)
            else:
                assert delta.id is None and delta.function.name is None
        assert sorted(opened) == list(range(len(whole.calls)))
    else:
        assert message.content == text
        assert got.completion.choices[0].finish_reason == "stop"
    return got


REPLIES = {
    "hermes": f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS_TEXT}}}'
    f'\n</tool_call>\n<tool_call>\n{{"name": "get_time", "arguments": {MORE_TEXT}}}\n</tool_call>',
    "llama3_json": f'<|python_tag|>{{"name": "get_weather", "parameters": {ARGS_TEXT}}}; '
    f'{{"name": "get_time", "parameters": {MORE_TEXT}}}',
    "mistral": f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {ARGS_TEXT}}}, '
    f'{{"name": "get_time", "arguments": {MORE_TEXT}}}]',
    "required": f'[{{"name": "get_weather", "parameters": {ARGS_TEXT}}}, '
    f'{{"name": "get_time", "parameters": {MORE_TEXT}}}]',
    "named": ARGS_TEXT,
}


@pytest.mark.parametrize("mode", sorted(REPLIES))
@pytest.mark.parametrize("size", [1, 3, 10_000])
def test_calls_stream_piece_by_piece(mode: str, size: int) -> None:
    text = REPLIES[mode]
    got = _check_same_as_whole(_plan(mode), [text[i : i + size] for i in range(0, len(text), size)])
    if size == 1:  # arguments arrive in many pieces, not at the end
        assert all(len(p) > 5 for p in got.argument_pieces.values())
        if mode == "hermes":
            assert got.completion.choices[0].message.content.startswith("Let me check.")


def test_mistral_name_and_args_form() -> None:
    text = f"[TOOL_CALLS]get_weather[ARGS]{ARGS_TEXT}"
    got = _check_same_as_whole(_plan("mistral"), list(text))
    assert len(got.argument_pieces[0]) > 5


@pytest.mark.parametrize("mode", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize(
    "text",
    ["Just words, no call.", "<tool_call>{not json</tool_call>", '{"no": "name"}', "<tool"],
)
def test_text_without_a_call_streams_as_content(mode: str, text: str) -> None:
    _check_same_as_whole(_plan(mode), list(text))


def test_content_is_not_held_back_without_a_marker() -> None:
    stream = ToolCallStream(_plan("hermes"))
    assert stream.feed("Hello there") == [{"content": "Hello there"}]
    assert stream.feed(" <tool_") == [{"content": " "}]  # may open a call: held back
    assert stream.feed("x>") == [{"content": "<tool_x>"}]


def test_a_call_cut_short_ends_as_it_stands() -> None:
    stream = ToolCallStream(_plan("hermes"))
    stream.feed('<tool_call>{"name": "get_weather", "arguments": {"city": "Pa')
    deltas, finish_reason = stream.finish("length")
    assert deltas == [] and finish_reason == "length"


def test_stable_arguments_leave_out_what_may_change() -> None:
    assert stable_arguments({"city": "Pa"}) == '{"city": "Pa'
    assert stable_arguments({}) == "{"
    assert stable_arguments({"a": ["x"]}) == '{"a": ["x'
    assert stable_arguments({"a": "x\ud83d"}) == '{"a": "x'


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None)
@given(
    mode=st.sampled_from(sorted(REPLIES)),
    arguments=st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=4),
    cuts=st.lists(st.integers(0, 400), max_size=40),
)
def test_any_arguments_cut_anywhere(mode: str, arguments: dict, cuts: list[int]) -> None:
    args_text = json.dumps(arguments, ensure_ascii=bool(len(cuts) % 2))
    text = {
        "hermes": f'<tool_call>{{"name": "f", "arguments": {args_text}}}</tool_call>',
        "llama3_json": f'{{"name": "f", "parameters": {args_text}}}',
        "mistral": f'[TOOL_CALLS][{{"name": "f", "arguments": {args_text}}}]',
        "required": f'[{{"name": "f", "parameters": {args_text}}}]',
        "named": args_text,
    }[mode]
    edges = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    _check_same_as_whole(_plan(mode), [text[a:b] for a, b in itertools.pairwise(edges)])
