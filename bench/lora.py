"""LoRA adapters: what a batch mixing adapters costs against the base model alone.

SmolLM2-135M-Instruct (``--model smollm2``, float32, de-quantized as the float benchmarks take
it) runs one workload twice in the offline engine: 16 requests at once (random-token prompts of
128 tokens, 128 output tokens, EOS ignored), once with no adapter and once with four PEFT
adapters (rank 16 over every projection of every layer, random A and B) mixed in one batch,
request i taking adapter i mod 4 (``max_loras`` 4). The two runs alternate ``--repeats``
times in one engine; output tokens/s are medians with every run given.

``--part router``: the router's adapter-aware placement against random spreading. A fleet of
three nodes (``pagedllm serve`` processes sharing this machine's cores, the benchmark model
unless ``--router-model`` names another) serves six adapters (rank 16) with
``--max-cpu-loras 2`` each; a stream of requests names the adapters in a seeded random order
(short random-word prompts, a few output tokens, ``--concurrency`` clients). The same stream
runs through a router with ``--policy prefix`` (adapter-aware) and one with ``--policy
random`` (what a Kubernetes Service does), each on fresh nodes, alternating ``--repeats``
times. Compared (medians): adapter loads (the sum over the nodes of
``pagedllm:lora_adapter_loads_total``) and TTFT p50; targets: fewer loads and a lower TTFT
p50 than random.

    python bench/lora.py [--part batch] [--repeats 3] [--requests 16] [--rank 16]
    python bench/lora.py --part router [--repeats 3] [--router-requests 90] [--concurrency 3]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import common

TARGET_MIXED_VS_BASE = 0.8
# --part router: six adapters over three nodes that each keep two loaded.
ROUTER_ADAPTERS = 6
ROUTER_OUTPUT_LEN = 4
LOADS = "pagedllm:lora_adapter_loads_total"
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model: Path, directory: Path, count: int, rank: int) -> list[Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(count):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(
            str(common.hf_model_dir(model)), dtype=torch.float32
        )
        config = LoraConfig(r=rank, target_modules=MODULES, init_lora_weights=False)
        path = directory / f"adapter-{i}"
        get_peft_model(base, config).save_pretrained(path)
        paths.append(path)
    return paths


def timed_run(llm: Any, workload: common.Workload, loras: list[Any]) -> float:
    from pagedllm.sampling_params import SamplingParams

    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.output_lens
    ]
    start = time.perf_counter()
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in workload.prompts],
        params,
        use_tqdm=False,
        lora_request=loras,
    )
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert tokens == workload.num_output_tokens
    return tokens / elapsed


def checked(
    args: argparse.Namespace,
    model: Path,
    runs: dict[str, Any],
    targets: list[common.Target],
    **more: Any,
) -> dict[str, Any]:
    """Print the targets; the results file's content."""
    common.print_targets(targets)
    return {
        "machine": common.machine_info(),
        "settings": vars(args),
        "model": common.model_summary(model),
        "runs": runs,
        **more,
        "targets": [t.to_json() for t in targets],
    }


def fleet_run(
    args: argparse.Namespace, model: Path, adapters: list[Path], policy: str, workdir: Path
) -> dict[str, Any]:
    """One policy's run on three fresh nodes: the stream's TTFTs, and the adapter loads."""
    import fleet
    from transformers import AutoTokenizer

    names = [f"adapter-{i}" for i in range(len(adapters))]
    extra = [
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-cpu-loras",
        "2",
        "--max-lora-rank",
        str(args.rank),
        "--lora-modules",
        *(f"{n}={p}" for n, p in zip(names, adapters, strict=True)),
    ]
    shape = argparse.Namespace(system_len=args.prompt_words * 4, question_len=0, output_len=16)
    nodes = fleet.start_nodes(shape, model, 3, 1 << 14, workdir, policy, extra=extra)
    try:
        router = fleet.start_router(model, nodes, policy, workdir)
        try:
            rng = random.Random(args.seed)
            tokenizer = AutoTokenizer.from_pretrained(str(common.hf_model_dir(model)))
            prompts = fleet.random_texts(tokenizer, args.router_requests, args.prompt_words, rng)
            stream = [(p, rng.choice(names)) for p in prompts]
            before = sum(m.get(LOADS, 0.0) for m in fleet.counters(nodes))
            result = asyncio.run(requests_through(router.url, stream, args.concurrency))
            loads = sum(m.get(LOADS, 0.0) for m in fleet.counters(nodes)) - before
            reasons = fleet.routed_by_reason(router)
        finally:
            router.stop()
    finally:
        for node in nodes:
            node.stop()
    return result.summary() | {"adapter_loads": loads, "routed_by_reason": reasons}


async def requests_through(url: str, stream: list[tuple[str, str]], concurrency: int) -> Any:
    """``concurrency`` clients sending the stream's (prompt, adapter) requests in order."""
    import fleet

    client = fleet.openai_client(url)
    result = fleet.LoadResult()
    queue = list(reversed(stream))

    async def one_client() -> None:
        while queue:
            prompt, adapter = queue.pop()
            await fleet.one_request(client, prompt, ROUTER_OUTPUT_LEN, result, model=adapter)

    begin = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    result.elapsed_s = time.perf_counter() - begin
    await client.close()
    return result


def router_part(args: argparse.Namespace) -> None:
    model = common.resolve_model(args.router_model)
    workdir = Path(tempfile.mkdtemp(prefix="pagedllm-lora-router-"))
    adapters = make_adapters(model, workdir, ROUTER_ADAPTERS, args.rank)
    runs: dict[str, list[dict[str, Any]]] = {"prefix": [], "random": []}
    for repeat in range(args.repeats):
        # Alternating, so that a slower stretch of the machine falls on both.
        for policy in ("prefix", "random") if repeat % 2 == 0 else ("random", "prefix"):
            print(f"run {repeat + 1}, policy {policy}: {args.router_requests} requests", flush=True)
            runs[policy].append(fleet_run(args, model, adapters, policy, workdir))
            print(f"    {runs[policy][-1]}", flush=True)
    fields = ("adapter_loads", "ttft_p50_ms", "ttft_p99_ms", "errors")
    medians = {
        policy: {f: statistics.median(run[f] for run in done) for f in fields}
        for policy, done in runs.items()
    }
    aware, spread = medians["prefix"], medians["random"]
    common.print_table(
        ["placement", "adapter loads", "TTFT p50 ms", "TTFT p99 ms", "errors", "runs (loads, p50)"],
        [
            [
                name,
                medians[policy]["adapter_loads"],
                medians[policy]["ttft_p50_ms"],
                medians[policy]["ttft_p99_ms"],
                medians[policy]["errors"],
                "; ".join(f"{r['adapter_loads']:g}, {r['ttft_p50_ms']:.0f}" for r in runs[policy]),
            ]
            for name, policy in (("adapter-aware (prefix)", "prefix"), ("random", "random"))
        ],
        title=f"3 nodes, {ROUTER_ADAPTERS} adapters (rank {args.rank}), --max-cpu-loras 2, "
        f"{args.router_requests} requests, concurrency {args.concurrency} "
        f"(medians of {args.repeats})",
    )
    # Both targets: adapter-aware below random (a ratio under 1).
    targets = [
        common.Target(
            f"{label}, adapter-aware / random",
            aware[field] / spread[field] if spread[field] else None,
            1.0,
            at_most=True,
            unit="x",
        )
        for label, field in (("adapter loads", "adapter_loads"), ("TTFT p50", "ttft_p50_ms"))
    ]
    results = checked(args, model, runs, targets, medians=medians)
    fig, (loads_ax, ttft_ax) = common.new_figure(2)
    labels = ["adapter-aware", "random"]
    loads_ax.bar(labels, [aware["adapter_loads"], spread["adapter_loads"]])
    loads_ax.set_ylabel("adapter loads (3 nodes)")
    ttft_ax.bar(labels, [aware["ttft_p50_ms"], spread["ttft_p50_ms"]])
    ttft_ax.set_ylabel("TTFT p50 (ms)")
    fig.suptitle(f"{ROUTER_ADAPTERS} LoRA adapters on 3 nodes, --max-cpu-loras 2")
    name = f"{args.name}-router"
    print(f"wrote {common.write_json(name, results)} and {common.save_figure(fig, name)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("batch", "router"), default="batch")
    parser.add_argument(
        "--router-model", help="(router) model directory (default: the bench model)"
    )
    parser.add_argument("--router-requests", type=int, default=90)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--prompt-words", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--name", default="lora")
    args = parser.parse_args()
    common.warn_if_busy()
    if args.part == "router":
        router_part(args)
        return
    common.set_threads(args.threads)
    from pagedllm.llm import LLM
    from pagedllm.lora.request import LoRARequest

    model = common.resolve_model(args.model)
    workload = common.make_workload(
        args.requests,
        common.vocab_size(model),
        prompt_len=args.prompt_len,
        prompt_spread=0,
        output_len=args.output_len,
        output_spread=0,
    )
    workdir = Path(tempfile.mkdtemp(prefix="pagedllm-lora-bench-"))
    paths = make_adapters(model, workdir, args.adapters, args.rank)
    adapters = [LoRARequest(f"adapter-{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    mixed = [adapters[i % len(adapters)] for i in range(args.requests)]
    base: list[Any] = [None] * args.requests
    llm = LLM(
        str(model),
        quantization=common.QUANTIZATION,
        dtype="float32",
        enable_lora=True,
        max_loras=args.adapters,
        max_lora_rank=args.rank,
        max_num_seqs=args.requests,
        kv_cache_memory=1 << 30,
        # Each run its own prompts' K/V: the prefix cache would serve the second run's prompts.
        enable_prefix_caching=False,
    )
    timed_run(llm, workload, mixed)  # warm-up: adapters loaded, kernels built
    runs: dict[str, list[float]] = {"base": [], "mixed": []}
    for repeat in range(args.repeats):
        order = ("base", "mixed") if repeat % 2 == 0 else ("mixed", "base")
        for name in order:
            runs[name].append(timed_run(llm, workload, base if name == "base" else mixed))
            print(f"run {repeat + 1} {name}: {runs[name][-1]:.1f} tokens/s", flush=True)
    medians = {name: statistics.median(values) for name, values in runs.items()}
    ratio = medians["mixed"] / medians["base"]
    common.print_table(
        ["batch", "output tok/s", "runs"],
        [
            ["base model alone", medians["base"], ", ".join(f"{v:.1f}" for v in runs["base"])],
            [
                f"{args.adapters} adapters mixed",
                medians["mixed"],
                ", ".join(f"{v:.1f}" for v in runs["mixed"]),
            ],
        ],
        title=f"{args.requests} requests at once, prompts {args.prompt_len}, outputs "
        f"{args.output_len}, rank {args.rank} (medians of {args.repeats})",
    )
    targets = [
        common.Target(
            f"tokens/s, {args.adapters} adapters mixed / base alone",
            ratio,
            TARGET_MIXED_VS_BASE,
            unit="x",
        ),
    ]
    results = checked(args, model, runs, targets, medians=medians, mixed_vs_base=ratio)
    fig, (ax,) = common.new_figure()
    ax.bar(["base alone", f"{args.adapters} adapters mixed"], [medians["base"], medians["mixed"]])
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"SmolLM2, {args.requests} requests at once, LoRA rank {args.rank}")
    print(f"wrote {common.write_json(args.name, results)} and {common.save_figure(fig, args.name)}")


if __name__ == "__main__":
    main()
