"""Every wire message, and the per-step pair in its columnar form, decodes to what was sent.

The cases come from the messages module itself: each message class registered there is drawn
from its type hints (with the constraints its constructor checks), so a message added later is
covered without touching this file, and one defined but not registered fails here.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.block_manager import block_hash, root_hash
from pagedllm.core.kv_events import HASH_BYTES, AdapterState, KVUpdate, NodeLoad
from pagedllm.core.kv_map import SHOWN_HASH_BYTES, KVMap, MapTotals, SeqBlocks
from pagedllm.core.step_plan import SeqSample, StepPlan, StepResult
from pagedllm.ipc import messages
from pagedllm.ipc.codec import WireError
from pagedllm.ipc.step_codec import decode_plan, decode_result, encode_plan, encode_result
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams

MESSAGE_CLASSES = sorted({s.cls for s in messages.SCHEMAS.values()}, key=lambda c: c.__name__)

# msgpack carries 64-bit integers.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
ints = st.integers(INT64_MIN, INT64_MAX)


@st.composite
def sampling_params(draw: st.DrawFn) -> SamplingParams:
    """Valid settings only: the decoder rebuilds them through the validating constructor."""
    n = draw(st.integers(1, 4))
    beam = draw(st.booleans())
    max_tokens = draw(st.none() | st.integers(1, 1 << 20))
    return SamplingParams(
        n=n,
        best_of=draw(st.integers(max(n, 2), 8)) if beam else draw(st.none() | st.integers(n, 8)),
        presence_penalty=draw(st.floats(-2.0, 2.0)),
        frequency_penalty=draw(st.floats(-2.0, 2.0)),
        repetition_penalty=draw(st.floats(0.01, 10.0)),
        temperature=draw(st.sampled_from([0.0, 1.0])) if beam else draw(st.floats(0.0, 5.0)),
        top_p=draw(st.floats(0.0, 1.0, exclude_min=True)),
        top_k=draw(st.integers(-1, 1000)),
        min_p=draw(st.floats(0.0, 1.0)),
        seed=draw(st.none() | ints),
        stop=draw(st.none() | st.text(min_size=1) | st.lists(st.text(min_size=1), max_size=3)),
        stop_token_ids=draw(st.none() | st.lists(st.integers(0, INT64_MAX), max_size=3)),
        include_stop_str_in_output=draw(st.booleans()),
        ignore_eos=draw(st.booleans()),
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens if max_tokens is not None else 1 << 20)),
        logprobs=draw(st.none() | st.integers(0, 20)),
        prompt_logprobs=draw(st.none() | st.integers(0, 20)),
        skip_special_tokens=draw(st.booleans()),
        use_beam_search=beam,
        length_penalty=draw(st.floats(allow_nan=False)),
    )


@st.composite
def seq_samples(draw: st.DrawFn) -> SeqSample:
    """One logprob per sampled token, as the workers send them."""
    tokens = draw(st.lists(ints, max_size=4))
    logprobs = draw(
        st.lists(st.floats(allow_nan=False), min_size=len(tokens), max_size=len(tokens))
    )
    top = draw(values_of(list[list[tuple[int, float]]] | None))
    return SeqSample(draw(ints), tokens, logprobs, top)


block_hashes = st.binary(min_size=HASH_BYTES, max_size=HASH_BYTES)


@st.composite
def kv_maps(draw: st.DrawFn) -> KVMap:
    """Block ids within the pool, columns of matching lengths, as ``KVMap`` checks."""
    n = draw(st.integers(1, 64))
    ids = st.lists(st.integers(0, n - 1), max_size=6)
    seqs = draw(
        st.lists(
            st.builds(SeqBlocks, st.text(max_size=8), st.integers(0, 8), st.integers(0, 99), ids),
            max_size=3,
        )
    )
    shared = draw(ids)
    cached = draw(ids)
    return KVMap(
        num_blocks=n,
        block_size=draw(st.integers(1, 64)),
        num_used=draw(st.integers(0, n)),
        seqs=seqs,
        shared_ids=shared,
        shared_refs=[draw(st.integers(2, 9)) for _ in shared],
        cached_ids=cached,
        cached_hashes=draw(
            st.binary(
                min_size=len(cached) * SHOWN_HASH_BYTES, max_size=len(cached) * SHOWN_HASH_BYTES
            )
        ),
        cached_reuses=[draw(st.integers(0, 9)) for _ in cached],
        totals=draw(values_of(MapTotals)),
    )


# Classes whose constructor or wire form constrains their fields beyond their type hints.
CONSTRAINED: dict[type, st.SearchStrategy[Any]] = {
    SamplingParams: sampling_params(),
    LoRARequest: st.builds(
        LoRARequest,
        lora_name=st.text(min_size=1, max_size=12),
        lora_int_id=st.integers(1, INT64_MAX),
        lora_path=st.text(min_size=1, max_size=12),
    ),
    SeqSample: seq_samples(),
    KVUpdate: st.builds(
        KVUpdate,
        stored=st.lists(st.tuples(block_hashes, block_hashes), max_size=4),
        removed=st.lists(block_hashes, max_size=4),
    ),
    AdapterState: st.builds(
        AdapterState,
        name=st.text(min_size=1, max_size=12),
        path=st.text(min_size=1, max_size=12),
        loaded=st.booleans(),
    ),
    NodeLoad: st.builds(
        NodeLoad,
        running=st.integers(0, INT64_MAX),
        waiting=st.integers(0, INT64_MAX),
        kv_usage=st.floats(0.0, 1.0),
    ),
    KVMap: kv_maps(),
    messages.CacheLayout: st.builds(
        messages.CacheLayout,
        block_size=st.integers(1, INT64_MAX),
        hash_seed=ints,
        num_blocks=st.integers(1, INT64_MAX),
    ),
}


@functools.cache
def values_of(tp: Any) -> st.SearchStrategy[Any]:
    """Values of type ``tp`` as the wire carries them (ints in int64, no NaN: NaN != NaN)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    simple = {
        int: ints,
        float: st.floats(allow_nan=False),
        bool: st.booleans(),
        str: st.text(max_size=12),
        bytes: st.binary(max_size=12),
        type(None): st.none(),
    }
    if tp in simple:
        return simple[tp]
    if origin is list:
        return st.lists(values_of(args[0]), max_size=4)
    if origin is tuple:
        return st.tuples(*(values_of(a) for a in args))
    if origin is dict:
        return st.dictionaries(values_of(args[0]), values_of(args[1]), max_size=4)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(values_of(a) for a in args))
    if tp in CONSTRAINED:
        return CONSTRAINED[tp]
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        fields = {f.name: values_of(hints[f.name]) for f in dataclasses.fields(tp) if f.init}
        return st.builds(tp, **fields)
    raise TypeError(f"no values for {tp!r}")


def test_every_message_class_of_the_module_is_registered() -> None:
    defined = {
        obj
        for obj in vars(messages).values()
        if isinstance(obj, type)
        and dataclasses.is_dataclass(obj)
        and obj.__module__ == messages.__name__
        and obj is not messages.Schema
    }
    union = set(typing.get_args(messages.Message))
    registered = set(MESSAGE_CLASSES)
    assert defined <= registered, f"defined but not registered: {defined - registered}"
    assert union == registered, f"Message and SCHEMAS differ: {union ^ registered}"
    assert {StepPlan, StepResult} <= registered


@pytest.mark.parametrize("cls", MESSAGE_CLASSES, ids=lambda c: c.__name__)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_message_survives_the_wire(cls: type, data: st.DataObject) -> None:
    message = data.draw(values_of(cls))
    wire = messages.encode(message)
    assert isinstance(wire, bytes)
    assert messages.decode(wire) == message


@settings(max_examples=100, deadline=None)
@given(plan=values_of(StepPlan))
def test_step_plan_columns_give_the_plan_back(plan: StepPlan) -> None:
    assert decode_plan(encode_plan(plan)) == plan


@settings(max_examples=100, deadline=None)
@given(result=values_of(StepResult))
def test_step_result_columns_give_the_result_back(result: StepResult) -> None:
    assert decode_result(encode_result(result)) == result


def test_kv_events_carry_real_block_hashes_and_heartbeats() -> None:
    root = root_hash(0)
    first = block_hash(root, list(range(16)))
    second = block_hash(first, list(range(16, 32)))
    load = NodeLoad(running=3, waiting=1, kv_usage=0.25)
    sent = messages.KVEvents(
        [KVUpdate(stored=[(first, root), (second, first)]), KVUpdate(removed=[second])], load
    )
    assert messages.decode(messages.encode(sent)) == sent
    heartbeat = messages.KVEvents([], load)
    assert messages.decode(messages.encode(heartbeat)) == heartbeat
    adapters = [AdapterState("sql", "/adapters/sql", True), AdapterState("law", "/l", False)]
    changed = messages.KVEvents([], load, adapters)
    assert messages.decode(messages.encode(changed)) == changed


@pytest.mark.parametrize(
    ("payload", "complaint"),
    [
        ([[[[[b"short", b"x" * 16]], []]], [0, 0, 0.0], None], "16 bytes"),
        ([[], [-1, 0, 0.0], None], "negative request counts"),
        ([[], [0, 0, 1.5], None], "kv_usage"),
        ([[], [0, 0], None], "NodeLoad"),
        ([[], [0, 0, 0.0], [["", "/a", True]]], "name and a path"),
    ],
)
def test_malformed_kv_events_are_refused(payload: Any, complaint: str) -> None:
    version = messages.SCHEMAS["kv_events"].version
    wire = msgpack.packb(["kv_events", version, payload], use_bin_type=True)
    with pytest.raises(WireError, match=complaint):
        messages.decode(wire)
