"""``--kv-cache-dtype``: vLLM's names, checked at the border; an 8-bit cache holds twice the
tokens of a bfloat16 one (four times a float32 one's) in the same memory, and serves."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.cli import build_parser
from pagedllm.config import KV_CACHE_DTYPES, EngineConfig
from pagedllm.serve.args import serve_args
from pagedllm.worker import kv_cache

MEMORY = 8 * 2**20


def test_the_names_are_vllms_and_anything_else_is_refused(capsys):
    assert KV_CACHE_DTYPES == ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head")
    assert kv_cache.cache_dtype("int8_per_token_head", torch.bfloat16) == torch.int8
    assert kv_cache.cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache.cache_dtype("fp8", torch.float32) == torch.float8_e4m3fn
    assert kv_cache.cache_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int4")
    parser = build_parser()
    ns = parser.parse_args(["serve", "--kv-cache-dtype", "fp8_e4m3"])
    assert serve_args(ns, parser).engine.kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--kv-cache-dtype", "fp4"])
    assert "invalid choice: 'fp4'" in capsys.readouterr().err


def test_the_same_memory_holds_twice_a_bfloat16_caches_tokens():
    blocks = {}
    kinds = [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "fp8")]
    for dtype, kv in [*kinds, ("bfloat16", "int8_per_token_head")]:
        llm = LLM(kv_cache_memory=MEMORY, max_model_len=256, dtype=dtype, kv_cache_dtype=kv)
        runner = llm.engine.runner
        blocks[dtype, kv] = runner.num_blocks
        assert runner.num_blocks * runner._block_bytes() <= MEMORY
        out = llm.generate(["one two three"], SamplingParams(temperature=0, max_tokens=8))
        assert len(out[0].outputs[0].token_ids) >= 1
        del llm
    assert blocks["bfloat16", "fp8"] >= 1.9 * blocks["bfloat16", "auto"]
    assert blocks["bfloat16", "fp8"] >= 3.8 * blocks["float32", "auto"]
    # int8 rows carry 2 bytes of scale per head: 66 bytes where bfloat16 takes 128 (head 64).
    assert blocks["bfloat16", "int8_per_token_head"] >= 1.9 * blocks["bfloat16", "auto"]


def test_int8_rows_are_refused_where_only_the_cpu_kernels_read_them():
    with pytest.raises(ValueError, match="int8_per_token_head is read by the CPU kernels only"):
        LLM(kv_cache_memory=MEMORY, kv_cache_dtype="int8_per_token_head", kernel_backend="triton")
