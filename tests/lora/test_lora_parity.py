"""Greedy parity with Hugging Face + PEFT: adapters made here by ``peft`` (random A and B:
``init_lora_weights=False``, since PEFT's default B = 0 makes an adapter a no-op), of ranks 8
and 16 over different projections, served in one batch that mixes three adapters and the base
model, give the tokens that PEFT's model gives for each."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM

from pagedllm.llm import LLM
from pagedllm.lora.request import LoRARequest
from pagedllm.models.demo import demo_model_dir
from pagedllm.models.named import named_model_path
from pagedllm.sampling_params import SamplingParams
from pagedllm_testing.lora_adapters import save_adapter

MAX_TOKENS = 12
ADAPTERS = {
    "attention-r8": LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    ),
    "all-r16": LoraConfig(
        r=16,
        lora_alpha=8,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        init_lora_weights=False,
    ),
    "mlp-r8-rslora": LoraConfig(
        r=8,
        lora_alpha=4,
        use_rslora=True,
        target_modules=["o_proj", "gate_proj", "down_proj"],
        init_lora_weights=False,
    ),
}


def load_hf(model: Path) -> torch.nn.Module:
    if model.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(
            str(model.parent), gguf_file=model.name, dtype=torch.float32
        ).eval()
    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def make_adapters(model: Path, directory: Path) -> dict[str, Path]:
    """Each adapter of ``ADAPTERS``, seeded, saved as PEFT saves it."""
    return {
        name: save_adapter(load_hf(model), config, directory / name, seed)
        for seed, (name, config) in enumerate(ADAPTERS.items())
    }


def hf_greedy(model: Path, adapter: Path | None, prompts: list[list[int]]) -> list[list[int]]:
    base = load_hf(model)
    hf = base if adapter is None else PeftModel.from_pretrained(base, adapter).eval()
    answers = []
    with torch.no_grad():
        for prompt in prompts:
            out = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            answers.append(out[0, len(prompt) :].tolist())
    return answers


def check_parity(model: Path, adapters: dict[str, Path], prompts: list[list[int]], **kwargs):
    llm = LLM(str(model), enable_lora=True, max_loras=3, dtype="float32", **kwargs)
    requests = [None] + [LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(adapters.items())]
    # Every prompt under every adapter and the base model, all in one batch.
    batch = [(i, r) for i in range(len(prompts)) for r in requests]
    outputs = llm.generate(
        [{"prompt_token_ids": prompts[i]} for i, _ in batch],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
        lora_request=[r for _, r in batch],
    )
    theirs = {name: hf_greedy(model, adapters.get(name), prompts) for name in [None, *adapters]}
    for (i, request), out in zip(batch, outputs, strict=True):
        name = None if request is None else request.lora_name
        assert out.outputs[0].token_ids == theirs[name][i], (name, prompts[i])
    # Each adapter changes the tokens: parity is not the base model's tokens four times over.
    for name in adapters:
        assert theirs[name] != theirs[None], name


def test_demo_model_with_three_adapters_and_the_base_in_one_batch(tmp_path):
    model = Path(demo_model_dir())
    adapters = make_adapters(model, tmp_path)
    prompts = [[1, 17, 300, 42, 9, 250, 77], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
    check_parity(model, adapters, prompts)


def test_smollm2_with_three_adapters_and_the_base_in_one_batch(tmp_path):
    model = named_model_path("smollm2")
    assert model is not None
    adapters = make_adapters(model, tmp_path)
    prompts = [[1, 504, 3458, 282, 4649, 314, 216], [1, 1558, 314, 253, 6512, 4767, 30]]
    # De-quantized: Hugging Face reads the GGUF file into float32 weights.
    check_parity(model, adapters, prompts, quantization="none")
