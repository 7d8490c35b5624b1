"""Adapters the engine cannot serve are refused when a request names them, with the problem
named, and the engine goes on serving; adapters run on quantized weights too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.llm import LLM
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams
from pagedllm_testing.lora_adapters import demo_adapter

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = {"prompt_token_ids": [1, 17, 300, 42, 9]}


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("adapters") / "good"
    return demo_adapter(directory, modules=["q_proj", "down_proj"], alpha=8)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2)


def broken(adapter: Path, tmp_path: Path, config=None, tensors=None) -> str:
    """A copy of ``adapter`` with its config updated by ``config`` and tensors by ``tensors``."""
    target = tmp_path / "broken"
    target.mkdir()
    settings = json.loads((adapter / "adapter_config.json").read_text())
    settings.update(config or {})
    (target / "adapter_config.json").write_text(json.dumps(settings))
    weights = load_file(adapter / "adapter_model.safetensors")
    weights.update(tensors or {})
    save_file(weights, target / "adapter_model.safetensors")
    return str(target)


def test_a_served_adapter_changes_the_tokens_and_the_base_is_unchanged(llm, adapter):
    base = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    request = LoRARequest("good", 1, str(adapter))
    adapted = llm.generate(PROMPT, GREEDY, use_tqdm=False, lora_request=request)
    assert adapted[0].outputs[0].token_ids != base
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == base


@pytest.mark.parametrize(
    "change,message",
    [
        ({"config": {"r": 16}}, "above --max-lora-rank 8"),
        ({"config": {"use_dora": True}}, "use_dora"),
        ({"config": {"bias": "all"}}, "bias"),
        ({"config": {"peft_type": "IA3"}}, "not LoRA"),
        (
            {"tensors": {"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)}},
            "cannot apply: base_model.model.lm_head",
        ),
        (
            {
                "tensors": {
                    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(
                        8, 3
                    )
                }
            },
            "layer 0 q_proj maps 3 ->",
        ),
        (
            {
                "tensors": {
                    "base_model.model.model.layers.99.self_attn.q_proj.lora_A.weight": torch.zeros(
                        8, 64
                    )
                }
            },
            "lora_A or lora_B alone for layer 99",
        ),
    ],
)
def test_an_adapter_the_engine_cannot_serve_is_refused_naming_the_problem(
    llm, adapter, tmp_path, change, message
):
    request = LoRARequest("broken", 2, broken(adapter, tmp_path, **change))
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        llm.generate(PROMPT, GREEDY, use_tqdm=False, lora_request=request)
    # Nothing was queued, and the engine serves the next request.
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 6


def test_a_missing_directory_or_file_is_refused(llm, tmp_path):
    for path, message in (
        (tmp_path / "nowhere", "no LoRA adapter directory"),
        (tmp_path, "no adapter_config.json"),
    ):
        with pytest.raises(ValueError, match=message):
            llm.generate(
                PROMPT, GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 3, str(path))
            )


def test_an_adapter_without_enable_lora_is_refused(adapter):
    llm = LLM()
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate(PROMPT, GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, str(adapter)))


def test_lora_settings_are_checked():
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(enable_lora=True, max_loras=3, max_cpu_loras=2)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(enable_lora=True, tensor_parallel_size=2)


def test_the_lru_keeps_max_cpu_loras_and_reloads_a_dropped_adapter(llm, adapter):
    manager = llm.engine.runner.loras
    answers = {}
    loads = manager.num_loads
    for name in ("one", "two", "three", "one"):
        request = LoRARequest(name, 10 + len(name), str(adapter))
        answers.setdefault(name, []).append(
            llm.generate(PROMPT, GREEDY, use_tqdm=False, lora_request=request)[0]
            .outputs[0]
            .token_ids
        )
        assert len(manager.loaded) <= 2
    assert manager.num_loads - loads == 4  # "one" was dropped by "three" and loaded again
    assert answers["one"][0] == answers["one"][1] == answers["two"][0]


def test_a_name_loaded_from_another_directory_is_another_adapter(llm, adapter, tmp_path):
    # As after an unload and a load at runtime: the new weights answer, not the old ones'
    # weights or cached blocks.
    first = LoRARequest("renamed", 20, str(adapter))
    old = llm.generate(PROMPT, GREEDY, use_tqdm=False, lora_request=first)
    other = demo_adapter(tmp_path / "other", seed=5, modules=["v_proj", "up_proj"], alpha=8)
    second = LoRARequest("renamed", 20, str(other))
    new = llm.generate(PROMPT, GREEDY, use_tqdm=False, lora_request=second)
    assert new[0].outputs[0].token_ids != old[0].outputs[0].token_ids
    fresh = LLM(enable_lora=True, max_lora_rank=8)
    alone = fresh.generate(PROMPT, GREEDY, use_tqdm=False, lora_request=second)
    assert new[0].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_adapters_run_on_quantized_weights(adapter):
    # int8 groups for the base model's linears; the adapter's products are added in float.
    llm = LLM(enable_lora=True, quantization="int8")
    base = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    request = LoRARequest("good", 1, str(adapter))
    adapted = llm.generate(PROMPT, GREEDY, use_tqdm=False, lora_request=request)
    assert len(adapted[0].outputs[0].token_ids) == 6
    assert adapted[0].outputs[0].token_ids != base
