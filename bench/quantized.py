"""Quantized weights: SmolLM2's Q4_1 GGUF file served by ``pagedllm serve`` with its weights
kept quantized (activations in ``--dtype``: bfloat16 where the CPU has AVX-512 BF16 or AMX),
beside the same file de-quantized to float32 (``--quantization none``) and beside llama.cpp's
own ``llama-server``.

Three parts, in one run:
1. Memory: the model's resident weight bytes (its distinct tensor storages) kept quantized and
   de-quantized, against the file's tensors; each server's largest process RSS once warm.
2. Quality, in-process: over 12 chat prompts, the quantized path teacher-forced on the float32
   path's 48 greedy tokens (argmax agreement; the first divergence of free generation per
   prompt), and perplexity on a fixed 2,000-token text (``pagedllm_testing.quality``).
3. Speed: streamed /v1/completions, closed loop, at each concurrency (``--concurrencies``),
   the servers measured one at a time with the others paused, ``--repeats`` times in
   alternating order (``bench/serving.py``'s ``measure``), medians reported with every run.

llama.cpp is built once from the source the ``llama-cpp-python`` sdist vendors
(``--setup-llama``, which ``make bench`` runs: cmake, ``-DGGML_NATIVE=ON`` without AMX,
minutes on 2 cores) and runs with the same threads, ``--parallel 16`` (its continuous
batching) and a context of 16 full requests.

    python bench/quantized.py [--concurrencies 1,4,16] [--duration 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import common
import llama_cpp
import serving

SERVERS = ("pagedllm", "pagedllm-float32", "llama.cpp")
LLAMA_PARALLEL = 16
QUALITY_TOKENS = 48
PROMPT_CHUNK = 256
# The targets.
MAX_WEIGHT_RATIO = 1.35
MIN_VS_FLOAT32_C1 = 2.0
MIN_VS_LLAMA_C1 = 0.8
MIN_VS_LLAMA_C16 = 1.5
MIN_AGREEMENT = 0.9
MAX_PERPLEXITY_CHANGE = 0.02


def make_servers(args: argparse.Namespace, model: str, workdir: Path) -> dict[str, Any]:
    env = serving.thread_env(args.threads)
    max_len = args.prompt_len + args.output_len + 64
    common_flags = ("--max-num-seqs", "256")
    servers = {
        "pagedllm": serving.Server(
            "pagedllm",
            serving.pagedllm_serve_command(
                model,
                args.port,
                args.dtype,
                args.kv_cache_memory,
                max_len,
                *common_flags,
                quantization="gguf",
            ),
            env,
            args.port,
            model,
        ),
        "pagedllm-float32": serving.Server(
            "pagedllm-float32",
            serving.pagedllm_serve_command(
                model,
                args.port + 1,
                "float32",
                args.kv_cache_memory,
                max_len,
                *common_flags,
                quantization="none",
            ),
            env,
            args.port + 1,
            model,
        ),
        "llama.cpp": serving.Server(
            "llama.cpp",
            [
                str(args.llama_server),
                "-m", model, "-t", str(args.threads), "-c", str(LLAMA_PARALLEL * max_len),
                "--parallel", str(LLAMA_PARALLEL), "--host", "127.0.0.1",
                "--port", str(args.port + 2),
            ],
            env,
            args.port + 2,
            model,
        ),
    }  # fmt: skip
    for server in servers.values():
        server.log = workdir / f"{server.name}.log"
    return servers


def group_rss_mb(pid: int) -> dict[str, float]:
    """The largest resident set among the processes of ``pid``'s process group, and their
    sum, in MB."""
    sizes = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != pid:
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    sizes.append(int(line.split()[1]) * 1024 / 1e6)
        except (OSError, ProcessLookupError):
            continue
    return {"largest_process_mb": max(sizes, default=0.0), "all_processes_mb": sum(sizes)}


def activation_dtype() -> str:
    """The quantized path's activations: bfloat16 where the kernels are built for AVX-512 BF16
    (every CPU with AMX has it: half the KV cache's bytes, and the prompts' GEMM without a
    conversion), float32 elsewhere."""
    from pagedllm.kernels.cpu_extension import cpu_flags

    return "bfloat16" if "avx512_bf16" in cpu_flags() else "float32"


def memory_and_quality(model: str, dtype: str) -> dict[str, Any]:
    """Weight bytes and the quality figures, with both models loaded in this process (the
    quantized one with ``dtype`` activations, as served)."""
    import gguf

    from pagedllm.models.loader import load_model
    from pagedllm.models.quantized import resident_weight_bytes
    from pagedllm.models.tokenizer import load_tokenizer
    from pagedllm_testing import quality

    tensors = gguf.GGUFReader(model).tensors
    by_type: dict[str, int] = {}
    for tensor in tensors:
        by_type[tensor.tensor_type.name] = by_type.get(tensor.tensor_type.name, 0) + int(
            tensor.n_bytes
        )
    kept, _ = load_model(model, dtype=dtype)
    dense, _ = load_model(model, dtype="float32", quantization="none")
    linears = sum(
        m.quantized.nbytes
        for name, m in kept.named_modules()
        if getattr(m, "quantized", None) is not None and name.startswith("model.layers")
    )
    embedding = kept.model.embed_tokens.quantized
    memory = {
        "file_tensor_bytes": sum(by_type.values()),
        "file_bytes_by_type": by_type,
        "kept_weight_bytes": resident_weight_bytes(kept),
        "dequantized_weight_bytes": resident_weight_bytes(dense),
        "kept_linear_bytes": linears,
        "kept_embedding_bytes": embedding.nbytes if embedding is not None else None,
        "head_shares_embedding": kept.lm_head.quantized is embedding,
    }
    tokenizer = load_tokenizer(model)
    prompts = []
    for question in quality.CHAT_QUESTIONS:
        chat = [{"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        reference = quality.greedy_tokens(dense, tokenizer.encode(text), QUALITY_TOKENS)
        ours = quality.greedy_tokens(kept, tokenizer.encode(text), QUALITY_TOKENS)
        agreement = quality.teacher_forced_agreement(kept, tokenizer.encode(text), reference)
        prompts.append(
            {
                "question": question,
                "agreement": agreement.fraction,
                "first_divergence": quality.first_divergence(ours, reference),
                "float32_text": tokenizer.decode(reference),
                "quantized_text": tokenizer.decode(ours),
            }
        )
    text_ids = tokenizer.encode(quality.TEXT.read_text())[: quality.TEXT_TOKENS]
    ppl_kept, ppl_dense = quality.perplexity(kept, text_ids), quality.perplexity(dense, text_ids)
    agreeing = sum(p["agreement"] * QUALITY_TOKENS for p in prompts)
    return {
        "memory": memory,
        "quality": {
            "teacher_forced_agreement": agreeing / (QUALITY_TOKENS * len(prompts)),
            "prompts": prompts,
            "perplexity_tokens": len(text_ids),
            "perplexity_quantized": ppl_kept,
            "perplexity_float32": ppl_dense,
            # Fed PROMPT_CHUNK tokens a step: the matmuls' GEMM path, which prompts take.
            "perplexity_quantized_prompt_path": quality.perplexity(kept, text_ids, PROMPT_CHUNK),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a GGUF file, or smollm2")
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--concurrencies", default="1,4,16")
    parser.add_argument("--duration", type=int, default=20, help="seconds per concurrency")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--dtype",
        choices=common.DTYPE_CHOICES,
        help="activations of the quantized path (default: bfloat16 where the CPU has AVX-512 "
        "BF16 or AMX, else float32); the de-quantized path is float32",
    )
    parser.add_argument("--port", type=int, default=8831)
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ready-timeout", type=float, default=300)
    parser.add_argument("--llama-dir", type=Path, default=llama_cpp.DEFAULT_DIR)
    parser.add_argument("--llama-server", type=Path, help="a built llama-server to use")
    parser.add_argument(
        "--setup-llama", action="store_true", help="build llama-server (once), then exit"
    )
    parser.add_argument("--name", default="quantized-smollm2")
    args = parser.parse_args()
    args.concurrencies = [int(c) for c in args.concurrencies.split(",")]
    if args.setup_llama:
        print(f"llama-server at {llama_cpp.setup(args.llama_dir)}")
        return
    args.llama_server = args.llama_server or llama_cpp.server_path(args.llama_dir)
    names = [s.strip() for s in args.servers.split(",") if s.strip()]
    if sorted(set(names) - set(SERVERS)):
        parser.error(f"unknown servers; known: {list(SERVERS)}")
    if "llama.cpp" in names and not args.llama_server.exists():
        parser.error(f"no llama-server at {args.llama_server}: run with --setup-llama once")
    common.warn_if_busy()
    model = str(common.resolve_model(args.model))
    args.dtype = args.dtype or activation_dtype()

    print(f"memory and quality (in-process; quantized path in {args.dtype}) ...", flush=True)
    offline = memory_and_quality(model, args.dtype)
    workdir = common.RESULTS / "tmp" / args.name
    workdir.mkdir(parents=True, exist_ok=True)
    servers = make_servers(args, model, workdir)
    rss: dict[str, dict[str, float]] = {}
    results, ready_s = serving.measure(
        names,
        servers,
        serving.run_own,
        args,
        workdir,
        on_ready=lambda name, proc: rss.__setitem__(name, group_rss_mb(proc.pid)),
    )
    report(args, model, names, servers, offline, results, ready_s, rss)


def report(
    args: argparse.Namespace,
    model: str,
    names: list[str],
    servers: dict[str, Any],
    offline: dict[str, Any],
    results: dict[str, list[dict]],
    ready_s: dict[str, float],
    rss: dict[str, dict[str, float]],
) -> None:
    memory, quality = offline["memory"], offline["quality"]
    mb = 1e6
    common.print_table(
        ["weights", "MB", "× file's tensors"],
        [
            ["file's tensors", memory["file_tensor_bytes"] / mb, 1.0],
            ["kept quantized", memory["kept_weight_bytes"] / mb,
             memory["kept_weight_bytes"] / memory["file_tensor_bytes"]],
            ["  of which layers' linears", memory["kept_linear_bytes"] / mb, None],
            ["  of which embedding (= head)", (memory["kept_embedding_bytes"] or 0) / mb, None],
            ["de-quantized (float32)", memory["dequantized_weight_bytes"] / mb,
             memory["dequantized_weight_bytes"] / memory["file_tensor_bytes"]],
        ],
        title="Resident weight bytes",
    )  # fmt: skip
    common.print_table(
        ["server", "largest process RSS MB", "all processes MB"],
        [[n, r["largest_process_mb"], r["all_processes_mb"]] for n, r in rss.items()],
        title="Memory once warm (KV cache included)",
    )
    common.print_table(
        ["question", "argmax agreement", "first divergence", "quantized answer"],
        [
            [p["question"][:40], p["agreement"], p["first_divergence"], p["quantized_text"][:50]]
            for p in quality["prompts"]
        ],
        title=f"Quality: teacher-forced on the float32 path's {QUALITY_TOKENS} greedy tokens",
    )
    rows = []
    for name, levels in results.items():
        for r in levels:
            runs = " ".join(f"{run['output_tokens_per_s']:.1f}" for run in r["runs"])
            rows.append(
                [name, r["concurrency"], r["errored"], r["output_tokens_per_s"],
                 r["ttft_p50_ms"], r["itl_p50_ms"], runs]
            )  # fmt: skip
    common.print_table(
        ["server", "concurrency", "errors", "output tok/s", "TTFT p50 ms", "ITL p50 ms", "runs"],
        rows,
        title=f"Streamed completions (medians of {args.repeats})",
    )

    def tps(name: str, concurrency: int) -> float | None:
        row = next((r for r in results.get(name, []) if r["concurrency"] == concurrency), None)
        return row["output_tokens_per_s"] if row else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    targets = [
        common.Target(
            "resident weight bytes vs the file's tensors",
            memory["kept_weight_bytes"] / memory["file_tensor_bytes"],
            MAX_WEIGHT_RATIO,
            at_most=True,
            unit="×",
        ),
        common.Target(
            "concurrency 1: tokens/s vs our float32 path",
            ratio(tps("pagedllm", 1), tps("pagedllm-float32", 1)),
            MIN_VS_FLOAT32_C1,
            unit="×",
        ),
        common.Target(
            "concurrency 1: tokens/s vs llama.cpp",
            ratio(tps("pagedllm", 1), tps("llama.cpp", 1)),
            MIN_VS_LLAMA_C1,
            unit="×",
        ),
        common.Target(
            "concurrency 16: tokens/s vs llama.cpp",
            ratio(tps("pagedllm", 16), tps("llama.cpp", 16)),
            MIN_VS_LLAMA_C16,
            unit="×",
        ),
        common.Target(
            "teacher-forced argmax agreement",
            quality["teacher_forced_agreement"],
            MIN_AGREEMENT,
        ),
        common.Target(
            "perplexity change vs float32",
            abs(quality["perplexity_quantized"] / quality["perplexity_float32"] - 1),
            MAX_PERPLEXITY_CHANGE,
            at_most=True,
            note=f"{quality['perplexity_quantized']:.3f} vs {quality['perplexity_float32']:.3f}; "
            f"{PROMPT_CHUNK} tokens a step: {quality['perplexity_quantized_prompt_path']:.3f}",
        ),
    ]
    common.print_targets(targets)
    data = {
        "benchmark": "quantized",
        "machine": common.machine_info(),
        "model": {"path": model},
        "workload": {
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "duration_s": args.duration,
            "concurrencies": args.concurrencies,
            "repeats": args.repeats,
            "threads": args.threads,
            "quantized_dtype": args.dtype,
        },
        "servers": {
            n: {"command": servers[n].command, "ready_s": ready_s.get(n), "rss": rss.get(n)}
            for n in names
        },
        **offline,
        "results": results,
        "targets": [t.to_json() for t in targets],
    }
    path = common.write_json(args.name, data)
    png = serving.plot(results, args.name)
    print(f"\nwrote {path} and {png}")


if __name__ == "__main__":
    main()
