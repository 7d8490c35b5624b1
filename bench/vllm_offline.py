"""vLLM's offline engine for the benchmarks; run with the vLLM venv's Python (``--vllm-venv``),
never imported: it needs only vLLM.

    VLLM_CPU_KVCACHE_SPACE=1 python -P bench/vllm_offline.py WORKLOAD.json RESULT.json
    VLLM_CPU_KVCACHE_SPACE=1 python -P bench/vllm_offline.py --serve SPEC.json

The first, for bench/throughput.py: the workload file holds the model directory, dtype, engine
limits, the prompts' token ids and each request's output length. The result: seconds and output
tokens of the timed run (every request queued at once, as for PagedLLM), and the engine's
start-up (its compile included).

The second, for bench/long_context.py, which alternates vLLM with other engines: the engine
(SPEC: model, dtype, KV cache dtype, limits; prefix caching on) is held open. Once it is up the
process prints one result line (the marker ``@@``, then JSON: start-up seconds, KV tokens), then
answers each request line on its standard input (JSON: ``prompts``, lists of token ids, and
``max_tokens``) with the seconds the batch took, every prompt queued at once, and the tokens it
generated. vLLM logs to standard output too, hence the marker.
"""

import json
import sys
import time

MARKER = "@@"
# Engine settings a spec may leave to vLLM's defaults.
OPTIONAL = ("kv_cache_dtype", "max_num_batched_tokens")


def make_llm(spec: dict, prefix_caching: bool):
    from vllm import LLM

    return LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec["max_num_seqs"],
        enable_prefix_caching=prefix_caching,
        seed=0,
        **{key: spec[key] for key in OPTIONAL if key in spec},
    )


def timed_generate(llm, prompt_ids: list[list[int]], params) -> tuple[float, int]:
    """Seconds and output tokens of one batch, every prompt queued at once."""
    from vllm import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def run_workload(workload_path: str, result_path: str) -> None:
    from vllm import SamplingParams

    with open(workload_path) as spec:
        workload = json.load(spec)
    started = time.perf_counter()
    llm = make_llm(workload, prefix_caching=False)
    startup_s = time.perf_counter() - started
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    timed_generate(llm, workload["prompts"][:2], warm)
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        for n in workload["output_lens"]
    ]
    elapsed, generated = timed_generate(llm, workload["prompts"], params)
    result = {"elapsed_s": elapsed, "output_tokens": generated, "startup_s": startup_s}
    with open(result_path, "w") as out:
        json.dump(result, out)


def answer(result: dict) -> None:
    print(MARKER + json.dumps(result), flush=True)


def serve(spec_path: str) -> None:
    from vllm import SamplingParams

    with open(spec_path) as file:
        spec = json.load(file)
    started = time.perf_counter()
    llm = make_llm(spec, prefix_caching=True)
    cache = llm.llm_engine.vllm_config.cache_config
    # Set in the engine's own process; None when this one was not told.
    blocks = cache.num_gpu_blocks
    answer(
        {
            "startup_s": time.perf_counter() - started,
            "kv_tokens": blocks * cache.block_size if blocks else None,
        }
    )
    for line in sys.stdin:
        request = json.loads(line)
        params = SamplingParams(temperature=0, max_tokens=request["max_tokens"], ignore_eos=True)
        elapsed, tokens = timed_generate(llm, request["prompts"], params)
        answer({"elapsed_s": elapsed, "output_tokens": tokens})


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(sys.argv[2])
    else:
        run_workload(sys.argv[1], sys.argv[2])
