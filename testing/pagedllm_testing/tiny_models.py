"""Tiny random checkpoints saved with transformers, for tests that compare against it."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from pagedllm.models.demo import demo_model_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def save_hf_model(directory: Path, config: PretrainedConfig, seed: int = 0, **save_kwargs):
    """A transformers model with random weights (biases and norms included), saved."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config)).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            offset = 1.0 if "norm" in name else 0.0
            param.copy_(offset + 0.1 * torch.randn_like(param))
    model.save_pretrained(directory, **save_kwargs)
    return model


def save_engine_model(directory: Path, config: PretrainedConfig, seed: int = 0):
    """A tiny checkpoint plus the demo model's tokenizer, loadable by the engine."""
    model = save_hf_model(directory, config, seed)
    for name in TOKENIZER_FILES:
        shutil.copy(demo_model_dir() / name, directory / name)
    return model
