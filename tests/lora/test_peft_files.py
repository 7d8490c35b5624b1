"""An adapter's files read without torch (what the scheduler and the command's checks see)
agree with the weights a worker loads, and ``--lora-modules`` takes vLLM's two forms."""

from __future__ import annotations

import argparse
import json
import struct

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from pagedllm.lora.adapter import load_adapter
from pagedllm.lora.peft_files import inspect_adapter, read_header
from pagedllm.models.demo import demo_model_dir
from pagedllm.serve.args import lora_module


def test_the_files_describe_the_weights(tmp_path):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(demo_model_dir(), dtype=torch.float32)
    config = LoraConfig(
        r=4, lora_alpha=12, target_modules=["k_proj", "up_proj"], init_lora_weights=False
    )
    get_peft_model(base, config).save_pretrained(tmp_path)
    files = inspect_adapter(str(tmp_path), max_rank=8)
    weights = load_adapter(str(tmp_path), 8, torch.float32)
    assert files.rank == weights.rank == 4 and files.scale == 3.0
    assert files.shapes == weights.shapes
    assert {module for _, module in files.shapes} == {"k_proj", "up_proj"}


def test_a_file_that_is_not_safetensors_is_named(tmp_path):
    bad = tmp_path / "adapter_model.safetensors"
    bad.write_bytes(struct.pack("<Q", 10) + b"not json!!")
    with pytest.raises(ValueError, match="not a safetensors file"):
        read_header(bad)
    bad.write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(ValueError, match="a safetensors header of"):
        read_header(bad)


def test_lora_modules_take_name_equals_path_and_json():
    assert lora_module("sql=/adapters/sql") == ("sql", "/adapters/sql")
    assert lora_module(json.dumps({"name": "poet", "path": "/a/p"})) == ("poet", "/a/p")
    for bad in ("sql", "=/a", "{not json", json.dumps({"name": "x"})):
        with pytest.raises(argparse.ArgumentTypeError):
            lora_module(bad)
