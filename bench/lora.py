"""LoRA adapters: what a batch mixing adapters costs against the base model alone.

SmolLM2-135M-Instruct (``--model smollm2``, float32, de-quantized as the float benchmarks take
it) runs one workload twice in the offline engine: 16 requests at once (random-token prompts of
128 tokens, 128 output tokens, EOS ignored), once with no adapter and once with four PEFT
adapters (rank 16 over every projection of every layer, random A and B) mixed in one batch,
request i taking adapter i mod 4 (``max_loras`` 4). The two runs alternate ``--repeats``
times in one engine; output tokens/s are medians with every run given.

The issue's second figure (the router's adapter-aware placement against random spreading on a
fleet of three pods) needs adapter-aware routing, which is not built yet: it is reported as not
measured.

    python bench/lora.py [--repeats 3] [--requests 16] [--rank 16]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import common

TARGET_MIXED_VS_BASE = 0.8
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
        common.Target(
            "adapter-aware routing: adapter loads and TTFT p50 against random spreading",
            None,
            1.0,
            note="adapter-aware routing is not built yet",
        ),
    ]
    common.print_targets(targets)
    results = {
        "machine": common.machine_info(),
        "settings": vars(args),
        "model": common.model_summary(model),
        "runs": runs,
        "medians": medians,
        "mixed_vs_base": ratio,
        "targets": [t.to_json() for t in targets],
    }
    fig, (ax,) = common.new_figure()
    ax.bar(["base alone", f"{args.adapters} adapters mixed"], [medians["base"], medians["mixed"]])
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"SmolLM2, {args.requests} requests at once, LoRA rank {args.rank}")
    print(f"wrote {common.write_json(args.name, results)} and {common.save_figure(fig, args.name)}")


if __name__ == "__main__":
    main()
