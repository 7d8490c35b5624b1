"""A worker's check of a step plan against what it holds, before it touches any state.

A plan that arrives well-formed but refers to sequences the worker does not have, blocks
outside its cache or positions past a sequence's blocks would otherwise fail half-applied
inside the model runner; the worker drops it instead, whole.
"""

from __future__ import annotations

from collections.abc import Container, Mapping

from pagedllm.core.lora_request import adapter_plan_problem
from pagedllm.core.step_plan import LAST_SAMPLE, NewSequence, StepPlan


def plan_problem(
    plan: StepPlan,
    seqs: Mapping[int, NewSequence],
    num_blocks: int,
    block_size: int,
    vocab_size: int,
    last_sampled: Container[int] = frozenset(),
    grammars: Container[str] | None = None,
    adapters: tuple[set[tuple[str, str]], int] | None = None,
) -> str | None:
    """What makes ``plan`` impossible to execute on ``seqs``, or None. ``last_sampled`` holds
    the sequences the worker has a sample of, which a ``LAST_SAMPLE`` token may stand for;
    ``grammars`` the keys of the grammars the worker can follow (None: it does not sample);
    ``adapters`` the LoRA adapters it holds loaded and how many fit (None: LoRA is off)."""
    # (tokens, blocks, computed) of every sequence as the plan leaves it
    gone = set(plan.finished)
    after: dict[int, tuple[int, int, int]] = {
        i: (len(s.token_ids), len(s.block_ids), s.num_computed_tokens)
        for i, s in seqs.items()
        if i not in gone
    }
    blocks: list[int] = [b for pair in plan.block_copies for b in pair]
    tokens: list[int] = []
    for new in plan.new:
        after[new.seq_id] = (len(new.token_ids), len(new.block_ids), new.num_computed_tokens)
        blocks += new.block_ids
        tokens += new.token_ids
    for update in plan.running:
        if update.seq_id not in after:
            return f"running update for unknown sequence {update.seq_id}"
        num_tokens, num_blocks_held, _ = after[update.seq_id]
        if not 0 <= update.blocks_from <= num_blocks_held:
            return f"sequence {update.seq_id}: blocks_from {update.blocks_from} out of range"
        after[update.seq_id] = (
            num_tokens + len(update.new_token_ids),
            update.blocks_from + len(update.block_ids),
            update.num_computed_tokens,
        )
        blocks += update.block_ids
        if LAST_SAMPLE in update.new_token_ids:
            if update.seq_id not in last_sampled or update.seq_id in gone:
                return f"sequence {update.seq_id}: no sample of the worker's to stand in for"
            tokens += [t for t in update.new_token_ids if t != LAST_SAMPLE]
        else:
            tokens += update.new_token_ids
    if blocks and not 0 <= min(blocks) <= max(blocks) < num_blocks:
        return f"block ids outside [0, {num_blocks})"
    if tokens and not 0 <= min(tokens) <= max(tokens) < vocab_size:
        return f"token ids outside [0, {vocab_size})"
    for seq_id, n in plan.scheduled:
        if seq_id not in after:
            return f"scheduled unknown sequence {seq_id}"
        num_tokens, num_blocks_held, computed = after[seq_id]
        end = computed + n
        known_end = end - len(plan.drafts.get(seq_id, ()))
        if n < 1 or computed < 0 or known_end > num_tokens or end > num_blocks_held * block_size:
            return f"sequence {seq_id}: cannot compute tokens {computed}..{end}"
    return (
        _misplaced_draft(plan, after, vocab_size)
        or _missing_grammar(plan, grammars)
        or _adapter_problem(plan, seqs, adapters)
    )


def _adapter_problem(
    plan: StepPlan,
    seqs: Mapping[int, NewSequence],
    adapters: tuple[set[tuple[str, str]], int] | None,
) -> str | None:
    """The plan's adapter loads and drops must fit what the worker holds, and leave loaded
    every adapter the step runs: the scheduler's LRU decides, the worker follows."""
    if adapters is None:
        if plan.lora_loads or plan.lora_drops:
            return "the plan loads or drops LoRA adapters, but LoRA is off"
        return None
    held, capacity = adapters
    problem = adapter_plan_problem(held, capacity, plan.lora_drops, plan.lora_loads)
    if problem is not None:
        return problem
    after = (held - set(plan.lora_drops)) | {r.key for r in plan.lora_loads}
    new = {s.seq_id: s for s in plan.new}
    for seq_id, _ in plan.scheduled:
        seq = new.get(seq_id) or seqs.get(seq_id)
        lora = None if seq is None else seq.lora
        if lora is not None and lora.key not in after:
            return f"sequence {seq_id} runs LoRA adapter {lora.lora_name!r}, which is not loaded"
    return None


def _misplaced_draft(
    plan: StepPlan, after: Mapping[int, tuple[int, int, int]], vocab_size: int
) -> str | None:
    """Drafts must be tokens and follow every known token of their sequence, which the step
    computes."""
    counts = dict(plan.scheduled)
    for seq_id, draft in plan.drafts.items():
        if not all(0 <= t < vocab_size for t in draft):
            return f"sequence {seq_id}: draft token ids outside [0, {vocab_size})"
        known = counts.get(seq_id, 0) - len(draft)
        if not draft or known < 1 or after[seq_id][2] + known != after[seq_id][0]:
            return f"sequence {seq_id}: drafts must follow all its tokens in a scheduled step"
    return None


def _missing_grammar(plan: StepPlan, grammars: Container[str] | None) -> str | None:
    if grammars is None:
        return None
    for new in plan.new:
        key = new.sampling.grammar_key
        if key is not None and key not in grammars:
            return f"sequence {new.seq_id} follows grammar {key}, which the worker does not hold"
    return None
