"""Structured outputs: what a JSON schema on every request costs.

Output tokens per second at batch 1 and 32 with a ``json_schema`` on every request, beside the
same requests unconstrained with the same output lengths (each constrained run is followed by
an unconstrained one that ignores EOS and stops at each output's length). The runs alternate
for ``--rounds`` rounds and the medians are compared, so that a shared machine's load falls on
both alike. And the time to the first token of a request whose schema is new (compiled for it)
beside one whose schema is cached, alternating, with where the new schema's time goes (compile,
the compiled form's trip to the worker, the matcher). The offline engine runs all of it, on the
benchmark model, so the numbers are the engine's own.

    python bench/structured.py [--batch-sizes 1,32] [--items 24] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path
from typing import Any

import common

TARGET_SLOWDOWN = 0.10  # at batch 32
TARGET_NEW_SCHEMA_MS = 50.0  # more time to the first token than with a cached schema


def schema(items: int, name: str = "values") -> dict[str, Any]:
    """An object holding one list of ``items`` bounded integers: its outputs have a steady
    length, and a new ``name`` makes a new schema."""
    return {
        "type": "object",
        "properties": {
            name: {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 999},
                "minItems": items,
                "maxItems": items,
            }
        },
        "required": [name],
        "additionalProperties": False,
    }


def _run(llm: Any, prompts: list[list[int]], params: list[Any]) -> tuple[float, list[int]]:
    engine = llm.engine
    start = time.perf_counter()
    for prompt, sp in zip(prompts, params, strict=True):
        engine.add_request({"prompt_token_ids": prompt}, sp)
    lengths: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                lengths[out.request_id] = len(out.outputs[0].token_ids)
    return time.perf_counter() - start, [lengths[k] for k in sorted(lengths, key=int)]


def throughput(
    llm: Any, batch: int, items: int, seed: int, vocab: int, rounds: int
) -> dict[str, Any]:
    from pagedllm import SamplingParams, StructuredOutputsParams

    workload = common.make_workload(batch, vocab, seed, prompt_len=64, prompt_spread=16)
    constraint = StructuredOutputsParams(json=schema(items), disable_any_whitespace=True)
    # Unseeded, as the unconstrained run: a seeded row draws from a generator of its own.
    constrained = [
        SamplingParams(temperature=1.0, max_tokens=512, structured_outputs=constraint)
        for _ in range(batch)
    ]
    with_schema, without = [], []
    tokens = free_tokens = 0
    for _ in range(rounds):
        with_schema_s, lengths = _run(llm, workload.prompts, constrained)
        free = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in lengths]
        without_s, free_lengths = _run(llm, workload.prompts, free)
        with_schema.append(sum(lengths) / with_schema_s)
        without.append(sum(free_lengths) / without_s)
        tokens += sum(lengths)
        free_tokens += sum(free_lengths)
    return {
        "batch": batch,
        "output_tokens": tokens,
        "unconstrained_output_tokens": free_tokens,
        "json_schema_tokens_per_s": statistics.median(with_schema),
        "unconstrained_tokens_per_s": statistics.median(without),
        "rounds_json_schema_tokens_per_s": with_schema,
        "rounds_unconstrained_tokens_per_s": without,
    }


def first_token_s(llm: Any, constraint: Any) -> float:
    from pagedllm import SamplingParams

    engine = llm.engine
    start = time.perf_counter()
    request_id = engine.add_request(
        {"prompt_token_ids": list(range(100, 164))},
        SamplingParams(max_tokens=4, structured_outputs=constraint),
    )
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.outputs and out.outputs[0].token_ids:
                elapsed = time.perf_counter() - start
                engine.abort_request(request_id)
                return elapsed


def time_to_first_token(llm: Any, items: int, repeats: int) -> dict[str, float]:
    from pagedllm import StructuredOutputsParams

    cached = StructuredOutputsParams(json=schema(items))
    first_token_s(llm, cached)  # compiled and cached
    cached_s, new_s = [], []
    for i in range(repeats):  # alternating, so that the machine's load falls on both alike
        cached_s.append(first_token_s(llm, cached))
        name = f"values_{i}_{time.time_ns()}"
        new_s.append(first_token_s(llm, StructuredOutputsParams(json=schema(items, name))))
    return {
        "cached_ms": statistics.median(cached_s) * 1e3,
        "new_ms": statistics.median(new_s) * 1e3,
        **new_schema_parts_ms(llm, items, repeats),
    }


def new_schema_parts_ms(llm: Any, items: int, repeats: int) -> dict[str, float]:
    """Medians of the steps a new schema takes before its first token: compiling it (the
    scheduler), carrying the compiled form to the worker and loading it there, and the
    matcher's first mask."""
    import xgrammar as xgr

    from pagedllm import StructuredOutputsParams

    compiler = llm.engine._grammar_compiler
    info = llm.engine.runner.grammars.info
    parts: dict[str, list[float]] = {"compile": [], "load": [], "first_mask": []}
    for i in range(repeats):
        params = StructuredOutputsParams(json=schema(items, f"parts_{i}_{time.time_ns()}"))
        start = time.perf_counter()
        ref = compiler.compile(params)
        loaded_at = time.perf_counter()
        compiled = xgr.CompiledGrammar.deserialize_json(ref.data, info)
        masked_at = time.perf_counter()
        bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
        end = time.perf_counter()
        parts["compile"].append(loaded_at - start)
        parts["load"].append(masked_at - loaded_at)
        parts["first_mask"].append(end - masked_at)
    return {f"{k}_ms": statistics.median(v) * 1e3 for k, v in parts.items()}


def plot(results: dict[str, Any], name: str) -> Path:
    fig, (left, right) = common.new_figure(ncols=2, width=10)
    rows = results["throughput"]
    labels = [str(r["batch"]) for r in rows]
    x = range(len(rows))
    left.bar(
        [i - 0.2 for i in x],
        [r["unconstrained_tokens_per_s"] for r in rows],
        0.4,
        label="no constraint",
    )
    left.bar(
        [i + 0.2 for i in x],
        [r["json_schema_tokens_per_s"] for r in rows],
        0.4,
        label="json_schema",
    )
    left.set_xticks(list(x), labels)
    left.set_xlabel("batch (requests at once)")
    left.set_ylabel("output tokens/s")
    left.legend()
    ttft = results["time_to_first_token"]
    right.bar(["cached schema", "new schema"], [ttft["cached_ms"], ttft["new_ms"]])
    right.set_ylabel("time to first token (ms, median)")
    return common.save_figure(fig, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: the ~100M benchmark model)")
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--items", type=int, default=24, help="integers in each output's list")
    parser.add_argument("--repeats", type=int, default=5, help="requests per TTFT median")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs per batch size")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="structured")
    args = parser.parse_args()

    common.set_threads(args.threads)
    common.warn_if_busy()
    from pagedllm import LLM

    model_dir = common.resolve_model(args.model)
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory=256 << 20)
    vocab = common.vocab_size(model_dir)
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        print(f"batch {batch} ...", flush=True)
        rows.append(throughput(llm, batch, args.items, args.seed, vocab, args.rounds))
        gc.collect()
    ttft = time_to_first_token(llm, args.items, args.repeats)
    for r in rows:
        r["slowdown"] = 1 - r["json_schema_tokens_per_s"] / r["unconstrained_tokens_per_s"]
    common.print_table(
        ["batch", "output tokens", "no constraint tok/s", "json_schema tok/s", "slowdown"],
        [
            [
                r["batch"],
                r["output_tokens"],
                r["unconstrained_tokens_per_s"],
                r["json_schema_tokens_per_s"],
                f"{r['slowdown']:.1%}",
            ]
            for r in rows
        ],
        title="Structured outputs: throughput",
    )
    cached, new = ttft["cached_ms"], ttft["new_ms"]
    print(f"\ntime to first token: cached schema {cached:.1f} ms, new {new:.1f} ms")
    print(
        f"a new schema's steps: compile {ttft['compile_ms']:.1f} ms, load in the worker "
        f"{ttft['load_ms']:.1f} ms, first mask {ttft['first_mask_ms']:.1f} ms"
    )
    biggest = max(rows, key=lambda r: r["batch"])
    targets = [
        common.Target(
            f"slowdown with a json_schema at batch {biggest['batch']}",
            biggest["slowdown"] * 100,
            TARGET_SLOWDOWN * 100,
            at_most=True,
            unit=" %",
        ),
        common.Target(
            "time to first token, new schema minus cached",
            ttft["new_ms"] - ttft["cached_ms"],
            TARGET_NEW_SCHEMA_MS,
            at_most=True,
            unit=" ms",
        ),
    ]
    common.print_targets(targets)
    results = {
        "model": common.model_summary(model_dir),
        "machine": common.machine_info(),
        "settings": vars(args),
        "throughput": rows,
        "time_to_first_token": ttft,
        "targets": [t.to_json() for t in targets],
    }
    print(common.write_json(args.name, results))
    print(plot(results, args.name))


if __name__ == "__main__":
    main()
