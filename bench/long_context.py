"""Long contexts: distinct prompts of ~3,000 tokens (no prefix shared between requests), 128
tokens out, SmolLM2 in bfloat16, at concurrency 1 and 8, with the KV cache in bfloat16
(``auto``) and in 8 bits (``int8_per_token_head``, ``fp8``).

    python bench/long_context.py [--repeats 3] [--kv auto,int8_per_token_head,fp8]

Each engine runs in this process, one after the other in each repeat (the order reversed every
other repeat); a figure is the median of the repeats. Per request set:

- TTFT: the wall time of the prompts alone (one output token), all queued at once, over the
  requests (at concurrency 1, one prompt's time to its first token);
- decode tokens/s: the same prompts run again for 128 tokens. The first run left their blocks
  in the prefix cache, so this run recomputes only each prompt's last partial block and then
  decodes: 128 tokens a request over the wall time, the decode steps reading a ~3,000-token
  cache each;
- the KV tokens the same ``--kv-cache-memory`` holds;
- the 8-bit caches' quality against the bfloat16 cache: perplexity on a fixed text of 2,000
  tokens, and teacher-forced argmax agreement on the 16-bit cache's greedy answers to 12 chat
  questions (``pagedllm_testing.quality``).

The time budget: about 2 minutes a repeat per cache kind and 4 minutes of quality checks, on a
2-core machine.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common

PROMPT_TOKENS = 3000
OUTPUT_TOKENS = 128
CONCURRENCIES = (1, 8)
KV_MEMORY = 1 << 30
KINDS = ("auto", "int8_per_token_head", "fp8")
QUALITY_CHUNK = 256
QUALITY_TOKENS = 48


def distinct_prompts(count: int, vocab: int, rng: random.Random) -> list[dict[str, list[int]]]:
    return [
        {"prompt_token_ids": [rng.randrange(common.FIRST_PLAIN_TOKEN, vocab) for _ in range(n)]}
        for n in [PROMPT_TOKENS] * count
    ]


def measure(llm: Any, prompts: list[dict[str, list[int]]]) -> dict[str, float]:
    from pagedllm import SamplingParams

    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, first, use_tqdm=False)
    prefill_s = time.perf_counter() - start
    rest = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, rest, use_tqdm=False)
    decode_s = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "ttft_s": prefill_s if len(prompts) == 1 else prefill_s / 2,
        "prefill_s": prefill_s,
        "decode_tokens_per_s": tokens / decode_s,
    }


def quality(model_name: str, kinds: list[str]) -> dict[str, dict[str, float]]:
    import torch

    from pagedllm.config import resolve_model_dir
    from pagedllm.models import decode_graph
    from pagedllm.models.loader import load_model
    from pagedllm.models.tokenizer import load_tokenizer
    from pagedllm.worker import kv_cache
    from pagedllm_testing import quality as q

    path = resolve_model_dir(model_name)
    model, _ = load_model(path, quantization="none", dtype="bfloat16")
    model.model.decode_graph = decode_graph.build(model.model)
    tokenizer = load_tokenizer(path)
    text = tokenizer.encode(q.TEXT.read_text())[: q.TEXT_TOKENS]
    base = q.perplexity(model, text, QUALITY_CHUNK)
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
            )
        )
        for question in q.CHAT_QUESTIONS
    ]
    references = [q.greedy_tokens(model, p, QUALITY_TOKENS) for p in prompts]
    results: dict[str, dict[str, float]] = {}
    for kind in kinds:
        if kind == "auto":
            continue
        dtype = kv_cache.cache_dtype(kind, torch.bfloat16)
        ppl = q.perplexity(model, text, QUALITY_CHUNK, cache_dtype=dtype)
        agreeing = positions = 0
        for prompt, reference in zip(prompts, references, strict=True):
            agreement = q.teacher_forced_agreement(model, prompt, reference, cache_dtype=dtype)
            agreeing, positions = agreeing + agreement.agreeing, positions + agreement.positions
        results[kind] = {
            "perplexity": ppl,
            "perplexity_16bit": base,
            "perplexity_change": ppl / base - 1,
            "argmax_agreement": agreeing / positions,
        }
    return results


def targets_of(
    kinds: list[str],
    median: Callable[[str, int, str], float],
    capacity: dict[str, int],
    scores: dict[str, dict[str, float]],
) -> list[common.Target]:
    """The issue's targets for the 8-bit caches, against the bfloat16 cache and the peers."""
    targets = []
    for kind in kinds:
        if kind == "auto" or "auto" not in kinds:
            continue
        speed = median(kind, 8, "decode_tokens_per_s") / median("auto", 8, "decode_tokens_per_s")
        targets.append(
            common.Target(
                f"{kind}: decode tokens/s at concurrency 8 over the bfloat16 cache's",
                speed,
                1.3,
                unit="x",
            )
        )
        targets.append(
            common.Target(
                f"{kind}: KV tokens in the same memory over the bfloat16 cache's",
                capacity[kind] / capacity["auto"],
                1.9,
                unit="x",
            )
        )
    for kind, score in scores.items():
        print(
            f"{kind}: perplexity {score['perplexity']:.3f} against "
            f"{score['perplexity_16bit']:.3f} ({100 * score['perplexity_change']:+.2f} %), "
            f"argmax agreement {100 * score['argmax_agreement']:.1f} %"
        )
        targets.append(
            common.Target(
                f"{kind}: teacher-forced argmax agreement with the bfloat16 cache",
                100 * score["argmax_agreement"],
                97,
                unit=" %",
            )
        )
        targets.append(
            common.Target(
                f"{kind}: perplexity change against the bfloat16 cache",
                100 * abs(score["perplexity_change"]),
                1,
                at_most=True,
                unit=" %",
            )
        )
    for peer in ("vLLM-CPU with fp8 (>= 1.2x at concurrency 8)", "llama.cpp q8_0 (>= 1x at 1)"):
        targets.append(
            common.Target(f"against {peer}", None, 1.0, note="peers not run by this script yet")
        )
    return targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv", default=",".join(KINDS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-quality", action="store_true")
    parser.add_argument("--name", default="long_context")
    parser.add_argument(
        "--from-results",
        type=Path,
        help="report again from the runs, KV tokens and quality of a JSON this script wrote",
    )
    args = parser.parse_args()
    kinds = [k.strip() for k in args.kv.split(",") if k.strip()]
    if args.from_results is not None:
        saved = json.loads(args.from_results.read_text())
        runs = {
            (key.split("@")[0], int(key.split("@")[1])): value
            for key, value in saved["runs"].items()
        }
        kinds = list(dict.fromkeys(kind for kind, _ in runs))
        capacity = {row["kv"]: row["kv_tokens"] for row in saved["table"]}
        report(args, kinds, runs, capacity, saved.get("quality", {}), saved["machine"])
        return
    common.set_threads(args.threads)
    common.warn_if_busy()
    runs, capacity = measure_all(args, kinds)
    scores = {} if args.no_quality else quality(args.model, kinds)
    report(args, kinds, runs, capacity, scores, common.machine_info())


Runs = dict[tuple[str, int], list[dict[str, float]]]


def measure_all(args: argparse.Namespace, kinds: list[str]) -> tuple[Runs, dict[str, int]]:
    """Every KV kind at every concurrency, ``args.repeats`` times, alternating the kinds."""
    from pagedllm import LLM

    engines = {
        kind: LLM(
            model=args.model,
            dtype="bfloat16",
            quantization="none",
            kv_cache_dtype=kind,
            kv_cache_memory=KV_MEMORY,
            max_model_len=PROMPT_TOKENS + OUTPUT_TOKENS + 64,
            max_num_seqs=max(CONCURRENCIES),
        )
        for kind in kinds
    }
    vocab = engines[kinds[0]].engine.runner.model_config.vocab_size
    capacity = {
        kind: llm.engine.runner.num_blocks * llm.engine.runner.block_size
        for kind, llm in engines.items()
    }
    rng = random.Random(0)
    runs: Runs = {}
    for repeat in range(args.repeats):
        order = kinds if repeat % 2 == 0 else kinds[::-1]
        for concurrency in CONCURRENCIES:
            prompts = distinct_prompts(concurrency, vocab, rng)  # the same for every kind
            for kind in order:
                # A fresh copy per engine: its prefix cache must not hold them from before.
                result = measure(engines[kind], [dict(p) for p in prompts])
                runs.setdefault((kind, concurrency), []).append(result)
                print(
                    f"repeat {repeat + 1}, concurrency {concurrency}, KV {kind}: "
                    f"TTFT {result['ttft_s']:.2f} s, "
                    f"decode {result['decode_tokens_per_s']:.1f} tokens/s",
                    flush=True,
                )
    return runs, capacity


def report(
    args: argparse.Namespace,
    kinds: list[str],
    runs: Runs,
    capacity: dict[str, int],
    scores: dict[str, dict[str, float]],
    machine: dict[str, Any],
) -> None:
    def median(kind: str, concurrency: int, key: str) -> float:
        return statistics.median(r[key] for r in runs[kind, concurrency])

    rows = [
        [
            kind,
            concurrency,
            median(kind, concurrency, "ttft_s"),
            median(kind, concurrency, "decode_tokens_per_s"),
            capacity[kind],
        ]
        for kind in kinds
        for concurrency in CONCURRENCIES
    ]
    common.print_table(
        ["KV cache", "concurrency", "TTFT s (median)", "decode tokens/s (median)", "KV tokens"],
        rows,
        title=f"Long contexts: {PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS} out, bfloat16",
    )
    targets = targets_of(kinds, median, capacity, scores)
    common.print_targets(targets)
    repeats = len(next(iter(runs.values())))
    results = {
        "benchmark": "long_context",
        "machine": machine,
        "model": args.model,
        "prompt_tokens": PROMPT_TOKENS,
        "output_tokens": OUTPUT_TOKENS,
        "repeats": repeats,
        "runs": {f"{k}@{c}": v for (k, c), v in runs.items()},
        "quality": scores,
        "table": [
            dict(
                zip(
                    ("kv", "concurrency", "ttft_s", "decode_tokens_per_s", "kv_tokens"),
                    r,
                    strict=True,
                )
            )
            for r in rows
        ],
        "targets": [t.to_json() for t in targets],
    }
    print(f"\nwrote {common.write_json(args.name, results)}")
    fig, (ax,) = common.new_figure()
    width = 0.8 / len(CONCURRENCIES)
    for i, concurrency in enumerate(CONCURRENCIES):
        ax.bar(
            [k + i * width for k in range(len(kinds))],
            [median(kind, concurrency, "decode_tokens_per_s") for kind in kinds],
            width,
            label=f"concurrency {concurrency}",
        )
    ax.set_xticks([k + width / 2 for k in range(len(kinds))], kinds)
    ax.set_ylabel("decode tokens/s (median)")
    ax.set_title(f"{PROMPT_TOKENS}-token contexts, SmolLM2 bfloat16, {repeats} repeats")
    ax.legend()
    print(f"wrote {common.save_figure(fig, args.name)}")


if __name__ == "__main__":
    main()
