"""Long contexts: distinct prompts of ~3,000 tokens (no prefix shared between requests), 128
tokens out, SmolLM2 in bfloat16, at concurrency 1 and 8: PagedLLM with the KV cache in bfloat16
(``auto``) and in 8 bits (``int8_per_token_head``, ``fp8``), beside vLLM's CPU build (KV
``auto`` and ``fp8``) and llama.cpp's server on a bfloat16 GGUF file written from the same
weights (its default cache, and ``-fa on -ctk q8_0 -ctv q8_0``).

    python bench/long_context.py [--repeats 3] [--kv auto,int8_per_token_head,fp8]
        [--peers vllm,llama.cpp] [--vllm-venv DIR] [--llama-dir DIR]

Every engine is started once and held open; in each repeat they run one after the other (the
order reversed every other repeat), the others paused; a figure is the median of the repeats.
PagedLLM runs in this process, vLLM's offline engine in its own venv (bench/vllm_offline.py),
llama-server over HTTP with one slot per request. Per request set:

- TTFT: the wall time of the prompts alone (one output token), all queued at once, over the
  requests (at concurrency 1, one prompt's time to its first token);
- decode tokens/s: the same prompts run again for 128 tokens. The first run left them in the
  engine's prefix cache (llama.cpp: in its slots), so this run recomputes only each prompt's
  last partial block and then decodes: 128 tokens a request over the wall time, the decode
  steps reading a ~3,000-token cache each;
- the KV tokens the same ``--kv-cache-memory`` holds (1 GiB; vLLM's is the same GiB);
- the 8-bit caches' quality against the bfloat16 cache: perplexity on a fixed text of 2,000
  tokens, and teacher-forced argmax agreement on the 16-bit cache's greedy answers to 12 chat
  questions (``pagedllm_testing.quality``).

The time budget, on a 2-core machine: the peers' start-up (vLLM compiles, a few minutes; the
bfloat16 GGUF file is written once), then about 3 minutes a repeat per PagedLLM cache and 5 per
peer configuration (their bfloat16 prompts are slower here), and 4 minutes of quality checks.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common
import llama_cpp
import serving

PROMPT_TOKENS = 3000
OUTPUT_TOKENS = 128
CONCURRENCIES = (1, 8)
KV_MEMORY = 1 << 30
KINDS = ("auto", "int8_per_token_head", "fp8")
MAX_LEN = PROMPT_TOKENS + OUTPUT_TOKENS + 64
PEERS = ("vllm", "llama.cpp")
VLLM_CACHES = ("auto", "fp8")
# llama-server's default cache, and its 8-bit one (a quantized V cache needs flash attention).
LLAMA_CACHES = {"default": [], "q8_0": ["-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"]}
HERE = Path(__file__).resolve().parent
VLLM_MARKER = "@@"  # bench/vllm_offline.py --serve: its result lines
# The targets for the 8-bit caches.
MIN_VS_AUTO = 1.3
MIN_VS_VLLM_FP8 = 1.2
MIN_VS_LLAMA_Q8 = 1.0
MIN_CAPACITY = 1.9
QUALITY_CHUNK = 256
QUALITY_TOKENS = 48


def distinct_prompts(count: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [
        [rng.randrange(common.FIRST_PLAIN_TOKEN, vocab) for _ in range(PROMPT_TOKENS)]
        for _ in range(count)
    ]


# An engine's run of a request set: (prompts' token ids, max tokens) -> (seconds, tokens out).
Run = Callable[[list[list[int]], int], tuple[float, int]]


@dataclass
class Engine:
    """One engine configuration, started once and held open for every repeat."""

    label: str
    run: Run
    kv_tokens: int | None  # what the 1 GiB of KV memory holds (llama.cpp: its fixed context)
    proc: subprocess.Popen | None = None  # a peer's process group, paused while others run


def measure(engine: Engine, prompts: list[list[int]]) -> dict[str, float]:
    prefill_s, _ = engine.run(prompts, 1)
    decode_s, tokens = engine.run(prompts, OUTPUT_TOKENS)
    return {
        "ttft_s": prefill_s if len(prompts) == 1 else prefill_s / 2,
        "prefill_s": prefill_s,
        "decode_tokens_per_s": tokens / decode_s,
    }


def pagedllm_engine(args: argparse.Namespace, kind: str) -> Engine:
    from pagedllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        quantization="none",
        kv_cache_dtype=kind,
        kv_cache_memory=KV_MEMORY,
        max_model_len=MAX_LEN,
        max_num_seqs=max(CONCURRENCIES),
    )

    def run(prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)

    runner = llm.engine.runner
    return Engine(kind, run, runner.num_blocks * runner.block_size)


def vllm_engine(args: argparse.Namespace, kv: str, workdir: Path) -> Engine:
    """vLLM's offline engine in its venv (bench/vllm_offline.py --serve), answering over a pipe."""
    spec = workdir / f"vllm-{kv}.json"
    spec.write_text(
        json.dumps(
            {
                "model": str(common.hf_model_dir(common.resolve_model(args.model))),
                "dtype": "bfloat16",
                "kv_cache_dtype": kv,
                "max_model_len": MAX_LEN,
                "max_num_seqs": max(CONCURRENCIES),
            }
        )
    )
    log_path = workdir / f"vllm-{kv}.log"
    log = log_path.open("w")
    # -P and a folder of its own: not bench/ or the repository first on its path.
    proc = subprocess.Popen(
        [
            str(args.vllm_venv / "bin" / "python"),
            "-P",
            str(HERE / "vllm_offline.py"),
            "--serve",
            str(spec),
        ],
        env=serving.vllm_env(args.threads, KV_MEMORY),
        cwd=workdir,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    stdin, stdout = proc.stdin, proc.stdout

    def result() -> dict[str, Any]:
        for line in stdout:
            if line.startswith(VLLM_MARKER):
                return json.loads(line[len(VLLM_MARKER) :])
            log.write(line)
        raise RuntimeError(f"vLLM's worker exited with {proc.wait()}; see {log_path}")

    try:
        ready = result()
    except BaseException:
        common.stop_process(proc)
        raise
    print(f"vLLM, KV {kv}: ready after {ready['startup_s']:.0f} s", flush=True)

    def run(prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        stdin.flush()
        answer = result()
        return answer["elapsed_s"], answer["output_tokens"]

    return Engine(f"vllm {kv}", run, ready["kv_tokens"], proc)


def llama_engine(args: argparse.Namespace, cache: str, gguf: Path, workdir: Path) -> Engine:
    """llama-server with a slot per request of the largest set, each slot a whole context,
    started and warmed as the serving benchmark starts its servers."""
    port = common.free_port()
    slots = max(CONCURRENCIES)
    server = serving.Server(
        f"llama.cpp-{cache}",
        [
            str(args.llama_server), "-m", str(gguf), "-t", str(args.threads),
            "-c", str(slots * MAX_LEN), "--parallel", str(slots),
            "--host", "127.0.0.1", "--port", str(port), *LLAMA_CACHES[cache],
        ],
        serving.thread_env(args.threads),
        port,
        str(gguf),
        log=workdir / f"llama.cpp-{cache}.log",
    )  # fmt: skip
    proc = serving.start(server, workdir)
    try:
        serving.wait_ready(server, proc, args.ready_timeout)
    except BaseException:
        common.stop_process(proc)
        raise
    url = f"http://127.0.0.1:{port}/completion"

    def one(prompt: list[int], max_tokens: int) -> int:
        body = {
            "prompt": prompt,
            "n_predict": max_tokens,
            "ignore_eos": True,
            "cache_prompt": True,  # the second run finds its prompt in its slot
            "temperature": 0,
        }
        return int(serving.post(url, body, timeout=3600)["tokens_predicted"])

    def run(prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        with ThreadPoolExecutor(len(prompts)) as pool:
            start = time.perf_counter()
            tokens = sum(pool.map(lambda p: one(p, max_tokens), prompts))
            return time.perf_counter() - start, tokens

    return Engine(f"llama.cpp {cache}", run, slots * MAX_LEN, proc)


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
    labels: list[str],
    median: Callable[[str, int, str], float],
    capacity: dict[str, int | None],
    scores: dict[str, dict[str, float]],
) -> list[common.Target]:
    """The issue's targets for the 8-bit caches (``kinds``: PagedLLM's), against the bfloat16
    cache and the peers' engines among ``labels``."""
    targets = []
    for kind in kinds:
        if kind == "auto" or "auto" not in kinds:
            continue
        speed = median(kind, 8, "decode_tokens_per_s") / median("auto", 8, "decode_tokens_per_s")
        targets.append(
            common.Target(
                f"{kind}: decode tokens/s at concurrency 8 over the bfloat16 cache's",
                speed,
                MIN_VS_AUTO,
                unit="x",
            )
        )
        targets.append(
            common.Target(
                f"{kind}: KV tokens in the same memory over the bfloat16 cache's",
                (capacity[kind] or 0) / (capacity["auto"] or 1),
                MIN_CAPACITY,
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
    for kind in kinds:
        if kind == "auto":
            continue
        for peer, concurrency, threshold in (
            ("vllm fp8", 8, MIN_VS_VLLM_FP8),
            ("llama.cpp q8_0", 1, MIN_VS_LLAMA_Q8),
        ):
            value = (
                median(kind, concurrency, "decode_tokens_per_s")
                / median(peer, concurrency, "decode_tokens_per_s")
                if peer in labels
                else None
            )
            targets.append(
                common.Target(
                    f"{kind}: decode tokens/s at concurrency {concurrency} over {peer}'s",
                    value,
                    threshold,
                    unit="x",
                    note="" if value is not None else "peer not run (--peers)",
                )
            )
    return targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv", default=",".join(KINDS), help="PagedLLM's KV cache dtypes")
    parser.add_argument("--peers", default=",".join(PEERS), help=f"of {', '.join(PEERS)}, or none")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-quality", action="store_true")
    parser.add_argument("--vllm-venv", type=Path, default=serving.DEFAULT_VLLM_VENV)
    parser.add_argument("--llama-dir", type=Path, default=llama_cpp.DEFAULT_DIR)
    parser.add_argument("--llama-server", type=Path, help="a built llama-server to use")
    parser.add_argument("--ready-timeout", type=float, default=600)
    parser.add_argument("--name", default="long_context")
    parser.add_argument(
        "--from-results",
        type=Path,
        help="report again from the runs, KV tokens and quality of a JSON this script wrote",
    )
    args = parser.parse_args()
    kinds = [k.strip() for k in args.kv.split(",") if k.strip()]
    peers = [p.strip() for p in args.peers.split(",") if p.strip() not in ("", "none")]
    if unknown := sorted(set(peers) - set(PEERS)):
        parser.error(f"unknown peers {unknown}; known: {list(PEERS)}")
    args.llama_server = args.llama_server or llama_cpp.server_path(args.llama_dir)
    if args.from_results is not None:
        saved = json.loads(args.from_results.read_text())
        runs = {
            (key.rsplit("@", 1)[0], int(key.rsplit("@", 1)[1])): value
            for key, value in saved["runs"].items()
        }
        labels = list(dict.fromkeys(label for label, _ in runs))
        capacity = {row["kv"]: row["kv_tokens"] for row in saved["table"]}
        report(args, labels, runs, capacity, saved.get("quality", {}), saved["machine"])
        return
    # The vLLM venv runs vLLM and llama.cpp's converter to a bfloat16 GGUF file.
    if peers and not (args.vllm_venv / "bin" / "python").exists():
        parser.error(
            f"no vLLM venv at {args.vllm_venv}: run `python bench/serving.py --setup-peers`"
        )
    if "llama.cpp" in peers and not args.llama_server.exists():
        parser.error(
            f"no llama-server at {args.llama_server}: run bench/quantized.py --setup-llama"
        )
    common.set_threads(args.threads)
    common.warn_if_busy()
    engines: list[Engine] = []
    try:
        start_engines(args, kinds, peers, engines)
        vocab = common.vocab_size(common.resolve_model(args.model))
        runs = measure_all(args, engines, vocab)
    finally:
        for engine in engines:
            if engine.proc is not None:
                serving.resume(engine.proc)
                common.stop_process(engine.proc)
    capacity = {engine.label: engine.kv_tokens for engine in engines}
    scores = {} if args.no_quality else quality(args.model, kinds)
    report(args, [e.label for e in engines], runs, capacity, scores, common.machine_info())


Runs = dict[tuple[str, int], list[dict[str, float]]]


def start_engines(
    args: argparse.Namespace, kinds: list[str], peers: list[str], engines: list[Engine]
) -> None:
    """Every engine into ``engines`` as it starts (so that the caller stops those started if
    one fails), each peer paused once it is up."""
    workdir = common.RESULTS / "tmp" / args.name
    workdir.mkdir(parents=True, exist_ok=True)
    engines += [pagedllm_engine(args, kind) for kind in kinds]
    if "vllm" in peers:
        for kv in VLLM_CACHES:
            engines.append(vllm_engine(args, kv, workdir))
    if "llama.cpp" in peers:
        hf_dir = common.hf_model_dir(common.resolve_model(args.model))
        gguf = llama_cpp.bf16_gguf(hf_dir, args.llama_dir, args.vllm_venv / "bin" / "python")
        for cache in LLAMA_CACHES:
            engines.append(llama_engine(args, cache, gguf, workdir))
    for engine in engines:
        if engine.proc is not None:
            serving.pause(engine.proc)


def measure_all(args: argparse.Namespace, engines: list[Engine], vocab: int) -> Runs:
    """Every engine at every concurrency, ``args.repeats`` times, alternating their order."""
    rng = random.Random(0)
    runs: Runs = {}
    for repeat in range(args.repeats):
        order = engines if repeat % 2 == 0 else engines[::-1]
        for concurrency in CONCURRENCIES:
            prompts = distinct_prompts(concurrency, vocab, rng)  # the same for every engine
            for engine in order:
                if engine.proc is not None:
                    serving.resume(engine.proc)
                # A fresh copy per engine: its prefix cache must not hold them from before.
                result = measure(engine, [list(p) for p in prompts])
                if engine.proc is not None:
                    serving.pause(engine.proc)
                runs.setdefault((engine.label, concurrency), []).append(result)
                print(
                    f"repeat {repeat + 1}, concurrency {concurrency}, {engine.label}: "
                    f"TTFT {result['ttft_s']:.2f} s, "
                    f"decode {result['decode_tokens_per_s']:.1f} tokens/s",
                    flush=True,
                )
    return runs


def report(
    args: argparse.Namespace,
    labels: list[str],
    runs: Runs,
    capacity: dict[str, int | None],
    scores: dict[str, dict[str, float]],
    machine: dict[str, Any],
) -> None:
    def median(label: str, concurrency: int, key: str) -> float:
        return statistics.median(r[key] for r in runs[label, concurrency])

    rows = [
        [
            label,
            concurrency,
            median(label, concurrency, "ttft_s"),
            median(label, concurrency, "decode_tokens_per_s"),
            " ".join(f"{r['decode_tokens_per_s']:.1f}" for r in runs[label, concurrency]),
            capacity[label],
        ]
        for label in labels
        for concurrency in CONCURRENCIES
    ]
    common.print_table(
        [
            "engine, KV cache",
            "concurrency",
            "TTFT s (median)",
            "decode tokens/s (median)",
            "runs' decode tokens/s",
            "KV tokens",
        ],
        rows,
        title=f"Long contexts: {PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS} out, bfloat16",
    )
    kinds = [label for label in labels if label in KINDS]
    targets = targets_of(kinds, labels, median, capacity, scores)
    common.print_targets(targets)
    repeats = len(next(iter(runs.values())))
    results = {
        "benchmark": "long_context",
        "machine": machine,
        "model": args.model,
        "prompt_tokens": PROMPT_TOKENS,
        "output_tokens": OUTPUT_TOKENS,
        "repeats": repeats,
        "runs": {f"{label}@{c}": v for (label, c), v in runs.items()},
        "quality": scores,
        "table": [
            {
                "kv": label,
                "concurrency": concurrency,
                "ttft_s": ttft,
                "decode_tokens_per_s": speed,
                "kv_tokens": tokens,
            }
            for label, concurrency, ttft, speed, _, tokens in rows
        ],
        "targets": [t.to_json() for t in targets],
    }
    print(f"\nwrote {common.write_json(args.name, results)}")
    fig, (ax,) = common.new_figure(width=8.0)
    width = 0.8 / len(CONCURRENCIES)
    for i, concurrency in enumerate(CONCURRENCIES):
        ax.bar(
            [k + i * width for k in range(len(labels))],
            [median(label, concurrency, "decode_tokens_per_s") for label in labels],
            width,
            label=f"concurrency {concurrency}",
        )
    names = [label if " " in label else f"pagedllm {label}" for label in labels]
    ax.set_xticks([k + width / 2 for k in range(len(labels))], names, rotation=30, ha="right")
    ax.set_ylabel("decode tokens/s (median)")
    ax.set_title(f"{PROMPT_TOKENS}-token contexts, SmolLM2 bfloat16, {repeats} repeats")
    ax.legend()
    print(f"wrote {common.save_figure(fig, args.name)}")


if __name__ == "__main__":
    main()
