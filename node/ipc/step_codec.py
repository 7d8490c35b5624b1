"""Columnar wire forms of the per-step messages (step plans and results).

They cross the process boundary twice per model step, so instead of one msgpack item per
running sequence, each per-sequence field travels as one raw array for the whole batch:
decoding a step of 256 decodes is a handful of ``frombuffer`` calls, not thousands of objects.
New sequences (rare) use the generic typed form.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedllm.core.lora_request import LoRARequest
from pagedllm.core.step_plan import (
    NewSequence,
    PromptLogprobs,
    RunningUpdate,
    SeqSample,
    StepPlan,
    StepResult,
)
from pagedllm.ipc.codec import WireError, decoder, encoder

_I8 = np.dtype("<i8")
_F8 = np.dtype("<f8")

_encode_new = encoder(list[NewSequence])
_decode_new = decoder(list[NewSequence])
_encode_prompt_logprobs = encoder(list[PromptLogprobs])
_decode_prompt_logprobs = decoder(list[PromptLogprobs])
_decode_pairs = decoder(list[tuple[int, int]])
_decode_top = decoder(list[list[tuple[int, float]]] | None)
_encode_top = encoder(list[list[tuple[int, float]]] | None)
_decode_grammars = decoder(dict[str, str])
_decode_dropped = decoder(list[str])
_encode_drafts = encoder(dict[int, list[int]])
_decode_drafts = decoder(dict[int, list[int]])
_encode_lora_drops = encoder(list[tuple[str, str]])
_decode_lora_drops = decoder(list[tuple[str, str]])
_encode_lora_loads = encoder(list[LoRARequest])
_decode_lora_loads = decoder(list[LoRARequest])


def _ints(values: list[int]) -> bytes:
    return np.asarray(values, dtype=_I8).tobytes()


def _floats(values: list[float]) -> bytes:
    return np.asarray(values, dtype=_F8).tobytes()


def _column(value: Any, dtype: np.dtype, length: int | None, name: str) -> list[Any]:
    if not isinstance(value, bytes) or len(value) % dtype.itemsize:
        raise WireError(f"{name}: expected {dtype} bytes")
    column = np.frombuffer(value, dtype=dtype).tolist()
    if length is not None and len(column) != length:
        raise WireError(f"{name}: expected {length} values, got {len(column)}")
    return column


def _split(flat: list[int], counts: list[int], name: str) -> list[list[int]]:
    if any(c < 0 for c in counts) or sum(counts) != len(flat):
        raise WireError(f"{name}: counts do not add up to the values")
    out = []
    start = 0
    for count in counts:
        out.append(flat[start : start + count])
        start += count
    return out


def encode_plan(plan: StepPlan) -> list[Any]:
    running = plan.running
    return [
        plan.step_id,
        _encode_new(plan.new),
        [
            _ints([u.seq_id for u in running]),
            _ints([len(u.new_token_ids) for u in running]),
            _ints([t for u in running for t in u.new_token_ids]),
            _ints([u.blocks_from for u in running]),
            _ints([len(u.block_ids) for u in running]),
            _ints([b for u in running for b in u.block_ids]),
            _ints([u.num_computed_tokens for u in running]),
        ],
        _ints([seq_id for seq_id, _ in plan.scheduled]),
        _ints([n for _, n in plan.scheduled]),
        {seq_id: n for seq_id, n in plan.num_samples.items()},
        _ints(plan.finished),
        [list(pair) for pair in plan.block_copies],
        plan.grammars,
        plan.dropped_grammars,
        _encode_drafts(plan.drafts),
        _encode_lora_drops(plan.lora_drops),
        _encode_lora_loads(plan.lora_loads),
    ]


def decode_plan(payload: Any) -> StepPlan:
    if not isinstance(payload, list) or len(payload) != 13:
        raise WireError("expected a step plan of 13 fields")
    (
        step_id,
        new,
        running,
        sched_ids,
        sched_counts,
        num_samples,
        finished,
        copies,
        grammars,
        dropped,
        drafts,
        lora_drops,
        lora_loads,
    ) = payload
    if type(step_id) is not int:
        raise WireError("step plan: step_id must be an int")
    if not isinstance(running, list) or len(running) != 7:
        raise WireError("step plan: expected 7 running-update columns")
    seq_ids = _column(running[0], _I8, None, "running seq ids")
    n = len(seq_ids)
    token_counts = _column(running[1], _I8, n, "running token counts")
    tokens = _split(_column(running[2], _I8, None, "running tokens"), token_counts, "tokens")
    blocks_from = _column(running[3], _I8, n, "running blocks_from")
    block_counts = _column(running[4], _I8, n, "running block counts")
    blocks = _split(_column(running[5], _I8, None, "running blocks"), block_counts, "blocks")
    computed = _column(running[6], _I8, n, "running computed counts")
    ids = _column(sched_ids, _I8, None, "scheduled ids")
    if not isinstance(num_samples, dict) or not all(
        type(k) is int and type(v) is int for k, v in num_samples.items()
    ):
        raise WireError("step plan: num_samples must map ints to ints")
    return StepPlan(
        step_id=step_id,
        new=_decode_new(new),
        running=[
            RunningUpdate(*fields)
            for fields in zip(seq_ids, tokens, blocks_from, blocks, computed, strict=True)
        ],
        scheduled=list(
            zip(ids, _column(sched_counts, _I8, len(ids), "scheduled counts"), strict=True)
        ),
        num_samples=num_samples,
        finished=_column(finished, _I8, None, "finished ids"),
        block_copies=_decode_pairs(copies),
        grammars=_decode_grammars(grammars),
        dropped_grammars=_decode_dropped(dropped),
        drafts=_decode_drafts(drafts),
        lora_drops=_decode_lora_drops(lora_drops),
        lora_loads=_decode_lora_loads(lora_loads),
    )


def encode_result(result: StepResult) -> list[Any]:
    samples = result.samples
    tops = [s.top_logprobs for s in samples]
    return [
        result.step_id,
        _ints([s.seq_id for s in samples]),
        _ints([len(s.token_ids) for s in samples]),
        _ints([t for s in samples for t in s.token_ids]),
        _floats([lp for s in samples for lp in s.logprobs]),
        [_encode_top(t) for t in tops] if any(t is not None for t in tops) else None,
        _encode_prompt_logprobs(result.prompt_logprobs),
    ]


def decode_result(payload: Any) -> StepResult:
    if not isinstance(payload, list) or len(payload) != 7:
        raise WireError("expected a step result of 7 fields")
    step_id, seq_ids, counts, tokens, logprobs, tops, prompt_logprobs = payload
    if type(step_id) is not int:
        raise WireError("step result: step_id must be an int")
    ids = _column(seq_ids, _I8, None, "sample seq ids")
    counts_list = _column(counts, _I8, len(ids), "sample counts")
    token_lists = _split(_column(tokens, _I8, None, "sample tokens"), counts_list, "tokens")
    flat_logprobs = _column(logprobs, _F8, None, "sample logprobs")
    if len(flat_logprobs) != sum(counts_list):
        raise WireError("step result: one logprob per sampled token expected")
    logprob_lists = []
    start = 0
    for count in counts_list:
        logprob_lists.append(flat_logprobs[start : start + count])
        start += count
    if tops is None:
        top_lists: list[Any] = [None] * len(ids)
    elif isinstance(tops, list) and len(tops) == len(ids):
        top_lists = [_decode_top(t) for t in tops]
    else:
        raise WireError("step result: top logprobs must be absent or one entry per sample")
    return StepResult(
        step_id=step_id,
        samples=[
            SeqSample(*fields)
            for fields in zip(ids, token_lists, logprob_lists, top_lists, strict=True)
        ],
        prompt_logprobs=_decode_prompt_logprobs(prompt_logprobs),
    )
