"""vLLM's offline engine on bench/throughput.py's workload; run by throughput.py with the vLLM
venv's Python (``--vllm-venv``), never imported: it needs only vLLM.

    VLLM_CPU_KVCACHE_SPACE=1 python -P bench/vllm_offline.py WORKLOAD.json RESULT.json

The workload file holds the model directory, dtype, engine limits, the prompts' token ids and
each request's output length. The result: seconds and output tokens of the timed run (every
request queued at once, as for PagedLLM), and the engine's start-up (its compile included).
"""

import json
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams, TokensPrompt

    with open(sys.argv[1]) as spec:
        workload = json.load(spec)
    started = time.perf_counter()
    llm = LLM(
        model=workload["model"],
        dtype=workload["dtype"],
        max_model_len=workload["max_model_len"],
        max_num_seqs=workload["max_num_seqs"],
        max_num_batched_tokens=workload["max_num_batched_tokens"],
        enable_prefix_caching=False,
        seed=0,
    )
    startup_s = time.perf_counter() - started
    prompts = [TokensPrompt(prompt_token_ids=p) for p in workload["prompts"]]
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts[:2], warm, use_tqdm=False)
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        for n in workload["output_lens"]
    ]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {"elapsed_s": elapsed, "output_tokens": generated, "startup_s": startup_s}
    with open(sys.argv[2], "w") as out:
        json.dump(result, out)


if __name__ == "__main__":
    main()
