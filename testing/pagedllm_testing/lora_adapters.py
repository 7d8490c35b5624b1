"""LoRA adapters for the tests, made by ``peft`` as users make them: random A and B
(``init_lora_weights=False``; PEFT's default B = 0 would make an adapter a no-op)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from pagedllm.models.demo import demo_model_dir


def save_adapter(base: torch.nn.Module, config: LoraConfig, directory: Path, seed: int) -> Path:
    """``config``'s adapter of ``base`` (which peft changes in place), its random weights
    seeded, saved in ``directory`` as PEFT saves it."""
    torch.manual_seed(seed)
    get_peft_model(base, config).save_pretrained(directory)
    return directory


def demo_adapter(
    directory: Path,
    seed: int = 0,
    modules: Sequence[str] = ("q_proj", "v_proj"),
    rank: int = 8,
    alpha: int = 64,
) -> Path:
    """An adapter of the built-in demo model, saved in ``directory``."""
    base = AutoModelForCausalLM.from_pretrained(demo_model_dir(), dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(modules), init_lora_weights=False
    )
    return save_adapter(base, config, directory, seed)
