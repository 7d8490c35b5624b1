"""An adapter's files read without torch (what the scheduler and the command's checks see)
agree with the weights a worker loads, and ``--lora-modules`` takes vLLM's two forms."""

from __future__ import annotations

import argparse
import json
import struct

import pytest
import torch

from pagedllm.lora.adapter import load_adapter
from pagedllm.lora.peft_files import inspect_adapter, read_header
from pagedllm.serve.args import lora_module
from pagedllm_testing.lora_adapters import demo_adapter


def test_the_files_describe_the_weights(tmp_path):
    demo_adapter(tmp_path, modules=["k_proj", "up_proj"], rank=4, alpha=12)
    files = inspect_adapter(str(tmp_path), max_rank=8)
    weights = load_adapter(str(tmp_path), files, torch.float32)
    assert files.rank == weights.rank == 4 and files.scale == 3.0
    shapes = {key: (a.shape[1], b.shape[0]) for key, (a, b) in weights.modules.items()}
    assert files.shapes == shapes
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
