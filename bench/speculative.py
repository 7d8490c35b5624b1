"""Speculative decoding (n-gram): output tokens/s with and without, on input-grounded work.

(a) SmolLM2-135M-Instruct (``--model smollm2``) answers the tasks of
    ``bench/data/speculative_tasks.json`` (copy a paragraph, summarise or extract from it, edit
    a code snippet: answers that repeat their input) through ``pagedllm serve``, greedy, by
    chat completions, closed loop at each concurrency (every client sends its next request
    when its last one ends). Two nodes run side by side, one with
    ``--speculative-config`` and one without; at concurrency 1 they take turns request by
    request (each request goes to both, which goes first alternating), above it their runs
    follow each other (off, on, then on, off, ...); the medians of the runs are reported.
    The speculating node's /metrics give the acceptance rate (accepted draft tokens / draft
    tokens) and the mean accepted length (tokens per verification step: accepted drafts + 1).
    Every answer of the speculating node must equal the other's.
(b) A workload that does not repeat: random-token prompts on the random-weight benchmark
    model, 32 requests at once, EOS ignored; with speculation it may be at most 5 % slower.

The machine is shared: run it under ``nice -n 5``; figures are medians of interleaved runs.

    python bench/speculative.py [--concurrencies 1,4,16] [--repeats 3] [--max-tokens 160]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import common
import serving

TASKS = Path(__file__).resolve().parent / "data" / "speculative_tasks.json"
SPECULATIVE_CONFIG = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}
TARGETS = {1: 1.8, 4: 1.3}
TARGET_RANDOM_SLOWDOWN = 0.05
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def speculative_config(args: argparse.Namespace) -> dict[str, Any]:
    return {**SPECULATIVE_CONFIG, "num_speculative_tokens": args.num_speculative_tokens}


def node(name: str, model: str, port: int, args: argparse.Namespace, spec: bool) -> serving.Server:
    command = serving.pagedllm_serve_command(model, port, "float32", args.kv_cache_memory, 2048)
    if spec:
        command += ["--speculative-config", json.dumps(speculative_config(args))]
    return serving.Server(name, command, serving.thread_env(args.threads), port, model)


def spec_counters(server: serving.Server) -> dict[str, float]:
    url = f"http://127.0.0.1:{server.port}/metrics"
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    totals = {}
    for key in SPEC_COUNTERS:
        match = re.search(rf"^vllm:spec_decode_{key}_total\{{[^}}]*\}} (\S+)$", text, re.M)
        totals[key] = float(match.group(1)) if match else 0.0
    return totals


def _client(server: serving.Server) -> Any:
    from openai import AsyncOpenAI

    return AsyncOpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", timeout=3600, max_retries=0
    )


async def _answer(client: Any, server: serving.Server, body: dict[str, Any]) -> tuple[str, int]:
    """One request's answer text and output tokens."""
    if "messages" in body:
        out = await client.chat.completions.create(model=server.model, **body)
        return out.choices[0].message.content or "", out.usage.completion_tokens
    out = await client.completions.create(model=server.model, **body)
    return out.choices[0].text, out.usage.completion_tokens


async def _closed_loop(
    server: serving.Server, requests: list[dict[str, Any]], concurrency: int
) -> tuple[float, list[str], int]:
    """(seconds, answer texts in request order, output tokens) of ``requests`` sent by
    ``concurrency`` clients."""
    texts = [""] * len(requests)
    tokens = 0
    queue = list(range(len(requests)))

    async def worker(client: Any) -> None:
        nonlocal tokens
        while queue:
            i = queue.pop(0)
            texts[i], n = await _answer(client, server, requests[i])
            tokens += n

    async with _client(server) as client:
        begin = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return time.perf_counter() - begin, texts, tokens


async def _in_turn(
    pair: dict[bool, serving.Server], requests: list[dict[str, Any]]
) -> dict[bool, tuple[float, list[str], int]]:
    """Each request to one node and then to the other (which goes first alternates): per
    node, (seconds, answer texts, output tokens)."""
    clients = {spec: _client(server) for spec, server in pair.items()}
    seconds = {spec: 0.0 for spec in pair}
    texts: dict[bool, list[str]] = {spec: [] for spec in pair}
    tokens = {spec: 0 for spec in pair}
    for i, body in enumerate(requests):
        for spec in (False, True) if i % 2 == 0 else (True, False):
            begin = time.perf_counter()
            text, n = await _answer(clients[spec], pair[spec], body)
            seconds[spec] += time.perf_counter() - begin
            texts[spec].append(text)
            tokens[spec] += n
    for client in clients.values():
        await client.close()
    return {spec: (seconds[spec], texts[spec], tokens[spec]) for spec in pair}


def _run(
    timed: tuple[float, list[str], int],
    server: serving.Server,
    before: dict[str, float] | None,
) -> dict[str, Any]:
    """A run's record; with the speculating node's counters ``before`` it, its drafts."""
    seconds, texts, tokens = timed
    run: dict[str, Any] = {
        "seconds": seconds,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / seconds,
        "texts": texts,
    }
    if before is not None:
        after = spec_counters(server)
        delta = {k: after[k] - before[k] for k in SPEC_COUNTERS}
        run["acceptance_rate"] = (
            delta["num_accepted_tokens"] / delta["num_draft_tokens"]
            if delta["num_draft_tokens"]
            else None
        )
        run["mean_accepted_length"] = (
            1 + delta["num_accepted_tokens"] / delta["num_drafts"] if delta["num_drafts"] else None
        )
        run["drafts"] = delta
    return run


def measure(
    pair: dict[bool, serving.Server],
    requests: list[dict[str, Any]],
    concurrency: int,
    on_first: bool,
) -> dict[bool, dict[str, Any]]:
    """One run of each node. At concurrency 1 the nodes take turns request by request: the
    shared machine's speed drifts by tens of percent within minutes, and so weighs on both
    alike; above it, one node's run follows the other's (the speculating node's first with
    ``on_first``)."""
    if concurrency == 1:
        before = spec_counters(pair[True])
        timed = asyncio.run(_in_turn(pair, requests))
        return {spec: _run(timed[spec], pair[spec], before if spec else None) for spec in pair}
    runs = {}
    for spec in (True, False) if on_first else (False, True):
        before = spec_counters(pair[True]) if spec else None
        timed_run = asyncio.run(_closed_loop(pair[spec], requests, concurrency))
        runs[spec] = _run(timed_run, pair[spec], before)
    return runs


def task_requests(count: int, max_tokens: int) -> list[dict[str, Any]]:
    tasks = json.loads(TASKS.read_text())["tasks"]
    return [
        {
            "messages": [
                {
                    "role": "user",
                    "content": f"{tasks[i % len(tasks)]['instruction']}\n\n"
                    f"{tasks[i % len(tasks)]['text']}",
                }
            ],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        for i in range(count)
    ]


def random_requests(count: int, vocab: int, prompt_len: int, max_tokens: int) -> list[dict]:
    workload = common.make_workload(
        count, vocab, seed=1, prompt_len=prompt_len, prompt_spread=0, output_len=max_tokens
    )
    return [
        {
            "prompt": p,
            "max_tokens": max_tokens,
            "temperature": 0,
            "extra_body": {"ignore_eos": True},
        }
        for p in workload.prompts
    ]


def alternate(
    pair: dict[bool, serving.Server], requests: list[dict], concurrency: int, repeats: int
) -> dict[str, Any]:
    """Runs of both nodes, ``repeats`` times; medians, and whether every answer matched."""
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for r in range(repeats):
        # Which node runs first alternates: each gets the machine just after the other's run
        # as often.
        both = measure(pair, requests, concurrency, on_first=r % 2 == 1)
        for spec in (False, True):
            run = both[spec]
            runs[spec].append(run)
            print(
                f"  c={concurrency} run {r + 1} spec={'on ' if spec else 'off'}: "
                f"{run['output_tokens_per_s']:.1f} tok/s"
                + (
                    f", acceptance {run['acceptance_rate']:.2f}"
                    if spec and run.get("acceptance_rate") is not None
                    else ""
                ),
                flush=True,
            )
    reference = runs[False][0]["texts"]
    mismatched = [
        i
        for run in runs[False] + runs[True]
        for i, (a, b) in enumerate(zip(reference, run["texts"], strict=True))
        if a != b
    ]

    def median(spec: bool, key: str) -> float | None:
        values = [run[key] for run in runs[spec] if run.get(key) is not None]
        return statistics.median(values) if values else None

    off = median(False, "output_tokens_per_s")
    on = median(True, "output_tokens_per_s")
    return {
        "concurrency": concurrency,
        "requests": len(requests),
        "off_tokens_per_s": off,
        "on_tokens_per_s": on,
        "speedup": on / off if on and off else None,
        "acceptance_rate": median(True, "acceptance_rate"),
        "mean_accepted_length": median(True, "mean_accepted_length"),
        "identical_outputs": not mismatched,
        "mismatched_requests": sorted(set(mismatched)),
        "runs": {
            "off": [{k: v for k, v in run.items() if k != "texts"} for run in runs[False]],
            "on": [{k: v for k, v in run.items() if k != "texts"} for run in runs[True]],
        },
        "sample_answer": reference[0][:400],
    }


def with_pair(model: str, args: argparse.Namespace, workdir: Path, body) -> Any:
    pair = {
        False: node("off", model, args.port, args, spec=False),
        True: node("on", model, args.port + 1, args, spec=True),
    }
    procs = []
    try:
        for server in pair.values():
            server.log = workdir / f"{server.name}-{args.port}.log"
            procs.append(serving.start(server, workdir))
        for server, proc in zip(pair.values(), procs, strict=True):
            serving.wait_ready(server, proc, timeout=900)
        return body(pair)
    finally:
        for proc in procs:
            serving.stop(proc)


def plot(results: dict[str, Any], name: str) -> Path:
    fig, (ax1, ax2) = common.new_figure(2)
    levels = results["grounded"]
    labels = [str(level["concurrency"]) for level in levels]
    x = range(len(levels))
    ax1.bar([i - 0.2 for i in x], [lv["off_tokens_per_s"] for lv in levels], 0.4, label="off")
    ax1.bar([i + 0.2 for i in x], [lv["on_tokens_per_s"] for lv in levels], 0.4, label="ngram")
    ax1.set_xticks(list(x), labels)
    ax1.set_xlabel("concurrency")
    ax1.set_ylabel("output tokens/s (median)")
    ax1.set_title("SmolLM2-135M, input-grounded tasks, greedy")
    ax1.legend()
    rnd = results["random"]
    ax2.bar(["off", "ngram"], [rnd["off_tokens_per_s"], rnd["on_tokens_per_s"]])
    ax2.set_ylabel("output tokens/s (median)")
    ax2.set_title(f"random prompts, random weights, {rnd['concurrency']} at once")
    return common.save_figure(fig, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--concurrencies", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=SPECULATIVE_CONFIG["num_speculative_tokens"],
        help="drafts per step (the speculating node's num_speculative_tokens)",
    )
    parser.add_argument("--random-batch", type=int, default=32)
    parser.add_argument("--random-max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-memory", type=int, default=512 << 20)
    parser.add_argument("--port", type=int, default=8710)
    parser.add_argument("--parts", default="grounded,random")
    parser.add_argument("--output", default="speculative")
    args = parser.parse_args()
    common.warn_if_busy()
    concurrencies = [int(c) for c in args.concurrencies.split(",")]
    parts = set(args.parts.split(","))
    results: dict[str, Any] = {
        "machine": common.machine_info(),
        "config": speculative_config(args),
    }
    results["settings"] = {k: v for k, v in vars(args).items()}
    workdir = Path(tempfile.mkdtemp(prefix="pagedllm-spec-bench-"))
    model = str(common.resolve_model(args.model))
    if "grounded" in parts:
        results["model"] = common.model_summary(Path(model))

        def grounded(pair: dict[bool, serving.Server]) -> list[dict]:
            levels = []
            for c in concurrencies:
                # Several requests a client, so that the level's time is not that of the one
                # client whose last answer happened to be long.
                requests = task_requests(max(8, args.requests_per_client * c), args.max_tokens)
                levels.append(alternate(pair, requests, c, args.repeats))
            return levels

        results["grounded"] = with_pair(model, args, workdir, grounded)
    if "random" in parts:
        bench_model = str(common.bench_model_dir())
        vocab = common.vocab_size(Path(bench_model))
        requests = random_requests(args.random_batch, vocab, 128, args.random_max_tokens)
        results["random"] = with_pair(
            bench_model,
            args,
            workdir,
            lambda pair: alternate(pair, requests, args.random_batch, args.repeats),
        )
    targets = []
    for level in results.get("grounded", []):
        if level["concurrency"] in TARGETS:
            targets.append(
                common.Target(
                    f"tokens/s with ngram / without, concurrency {level['concurrency']}",
                    level["speedup"],
                    TARGETS[level["concurrency"]],
                    unit="x",
                )
            )
        targets.append(
            common.Target(
                f"identical greedy outputs, concurrency {level['concurrency']}",
                float(level["identical_outputs"]),
                1.0,
            )
        )
    if "random" in results:
        rnd = results["random"]
        slowdown = 1 - rnd["speedup"] if rnd["speedup"] else None
        targets.append(
            common.Target(
                f"slowdown on random prompts, batch {args.random_batch}",
                slowdown,
                TARGET_RANDOM_SLOWDOWN,
                at_most=True,
            )
        )
    rows = [
        [
            "grounded",
            lv["concurrency"],
            lv["off_tokens_per_s"],
            lv["on_tokens_per_s"],
            lv["speedup"],
            lv["acceptance_rate"],
            lv["mean_accepted_length"],
            lv["identical_outputs"],
        ]
        for lv in results.get("grounded", [])
    ]
    if "random" in results:
        rnd = results["random"]
        rows.append(
            [
                "random",
                rnd["concurrency"],
                rnd["off_tokens_per_s"],
                rnd["on_tokens_per_s"],
                rnd["speedup"],
                rnd["acceptance_rate"],
                rnd["mean_accepted_length"],
                rnd["identical_outputs"],
            ]
        )
    common.print_table(
        [
            "workload",
            "concurrency",
            "off tok/s",
            "ngram tok/s",
            "speed-up",
            "acceptance",
            "mean accepted len",
            "identical",
        ],
        rows,
        "Speculative decoding (medians of interleaved runs)",
    )
    common.print_targets(targets)
    results["targets"] = [t.to_json() for t in targets]
    results["machine"]["load_average_1m_at_end"] = common.machine_info()["load_average_1m_at_end"]
    print(f"\nwrote {common.write_json(args.output, results)}")
    if "grounded" in results and "random" in results:
        print(f"wrote {plot(results, args.output)}")


if __name__ == "__main__":
    main()
