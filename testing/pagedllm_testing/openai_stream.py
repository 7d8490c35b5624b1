"""Streamed chat chunks put together the way the openai SDK does it
(``ChatCompletionStreamState``, which ``client.chat.completions.stream`` runs on), with the
SDK's events, so that tests see what an application sees."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from openai import LengthFinishReasonError
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk


@dataclass
class Accumulated:
    completion: ChatCompletion
    # Per call index: the argument pieces as the SDK's events gave them (the events name no
    # choice, so these are for one-choice streams).
    argument_pieces: dict[int, list[str]] = field(default_factory=dict)
    # Every raw tool-call delta, in order, per choice.
    call_deltas: dict[int, list[Any]] = field(default_factory=dict)


def accumulate(chunks: Iterable[ChatCompletionChunk | dict[str, Any]]) -> Accumulated:
    state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
    pieces: dict[int, list[str]] = {}
    deltas: dict[int, list[Any]] = {}
    for chunk in chunks:
        if isinstance(chunk, dict):
            chunk = ChatCompletionChunk.model_validate(chunk)
        for choice in chunk.choices:
            deltas.setdefault(choice.index, []).extend(choice.delta.tool_calls or [])
        for event in state.handle_chunk(chunk):
            if event.type == "tool_calls.function.arguments.delta":
                pieces.setdefault(event.index, []).append(event.arguments_delta)
    try:
        completion: ChatCompletion = state.get_final_completion()
    except LengthFinishReasonError:  # the SDK's parse step refuses a cut reply; the rest holds
        completion = state.current_completion_snapshot
    return Accumulated(completion, pieces, deltas)
