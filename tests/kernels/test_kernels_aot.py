"""Every Triton kernel configuration the dispatchers can choose compiles for sm_80, sm_86,
sm_89 and sm_90, without spilling registers and within each target's shared memory.

Runs ``bench/kernels_aot.py`` (no GPU needed: Triton's compiler and NVIDIA's ``ptxas`` ship
with the Triton wheel) in its own process, since this one has imported Triton to interpret.
Its results are cached by kernel source, specialisation and Triton version, so only changed
kernels recompile.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "kernels_aot.py"
TARGETS = {"80", "86", "89", "90"}
HEAD_DIMS = {64, 80, 96, 128, 256}
DTYPES = {"fp16", "bf16", "fp32"}
MODES = {"decode", "decode split-KV", "chunked prefill", "mixed"}
# 8-bit caches, read in the activations' dtype ("fp16/e4m3"), at fewer head sizes.
FP8_CACHES = {"e4m3", "e5m2"}
FP8_HEAD_DIMS = {64, 128}
# Triton has no fp8e4nv below sm_89: the dispatcher refuses e4m3 caches there.
E4M3_REFUSED_TARGETS = {"80", "86"}


@pytest.fixture(scope="module")
def aot_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    output = tmp_path_factory.mktemp("aot") / "kernels_aot.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(output)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    if not output.exists():
        pytest.fail(f"kernels_aot.py wrote no results:\n{done.stdout}\n{done.stderr}")
    report = json.loads(output.read_text())
    report["table"] = done.stdout
    return report


@pytest.mark.timeout(3100)
def test_every_configuration_compiles_without_spills_within_shared_memory(aot_report: dict):
    failures = [
        f"{row['config']}: {failure}" for row in aot_report["rows"] for failure in row["failures"]
    ]
    assert not failures, "\n".join(failures[:40]) + f"\n({len(failures)} in all)"
    for row in aot_report["rows"]:
        assert set(row["results"]) == TARGETS, row["config"]
        for result in row["results"].values():
            if not result["refused"]:
                assert result["registers"] > 0 and result["num_warps"] > 0, row["config"]


@pytest.mark.timeout(3100)
def test_e4m3_caches_are_refused_below_sm_89_and_compiled_from_it(aot_report: dict):
    for row in aot_report["rows"]:
        config = row["config"]
        refused = {target for target, result in row["results"].items() if result["refused"]}
        if config["kernel"] == "attention" and config["dtype"].endswith("/e4m3"):
            assert refused == E4M3_REFUSED_TARGETS, config
            for target in refused:
                assert "no fp8e4nv below sm_89" in row["results"][target]["refused"]
        else:
            assert not refused, config


@pytest.mark.timeout(3100)
def test_the_check_covers_every_configuration_of_the_issue(aot_report: dict):
    attention = [
        row["config"] for row in aot_report["rows"] if row["config"]["kernel"] == "attention"
    ]
    covered = {(c["klass"], c["dtype"], c["head_dim"]) for c in attention}
    # fp32 caches above head size 128 are refused by the dispatcher (see the test below).
    wanted = {(m, d, h) for m in MODES for d in DTYPES for h in HEAD_DIMS}
    wanted = {(m, d, h) for m, d, h in wanted if d != "fp32" or h <= 128}
    wanted |= {
        (m, f"{d}/{c}", h) for m in MODES for d in DTYPES for c in FP8_CACHES for h in FP8_HEAD_DIMS
    }
    assert covered == wanted
    details = {c["detail"] for c in attention}
    for group in (1, 2, 4, 8):
        assert f"group {group}" in details and f"group {group}, window" in details
    kernels = {row["config"]["kernel"] for row in aot_report["rows"]}
    assert kernels == {"attention", "split-KV merge", "KV write", "block copy"}
    writes = {(c["dtype"], c["head_dim"]) for c in _configs(aot_report, "KV write")}
    assert writes >= {(f"{d}/{c}", h) for d in DTYPES for c in FP8_CACHES for h in FP8_HEAD_DIMS}
    copies = {c["dtype"] for c in _configs(aot_report, "block copy")}
    assert copies == DTYPES | FP8_CACHES


def _configs(aot_report: dict, kernel: str) -> list[dict]:
    return [row["config"] for row in aot_report["rows"] if row["config"]["kernel"] == kernel]


def test_fp32_caches_above_head_size_128_are_refused_on_the_gpu_path():
    done = subprocess.run(
        [sys.executable, "-c", REFUSAL_SCRIPT], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_e4m3_caches_are_refused_below_sm_89_on_the_gpu_path():
    done = subprocess.run(
        [sys.executable, "-c", E4M3_REFUSAL_SCRIPT], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


# Compiled (not interpreted) kernels, as on a GPU: the launch is refused before any compile.
REFUSAL_SCRIPT = """
import os
os.environ["TRITON_INTERPRET"] = "0"
import torch
from pagedllm.kernels.unified_attention import unified_attention
cache = torch.zeros(2, 16, 1, 256)
q = torch.zeros(1, 1, 256)
try:
    unified_attention(q, cache, cache, torch.zeros(1, 2, dtype=torch.int32),
                      torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                      0.1, None, 1, 1, (9, 0))
except ValueError as error:
    assert "float32 KV caches up to head size 128" in str(error), error
else:
    raise AssertionError("a float32 cache of head size 256 was accepted")
"""

E4M3_REFUSAL_SCRIPT = """
import os
os.environ["TRITON_INTERPRET"] = "0"
import torch
from pagedllm.kernels.unified_attention import unified_attention
q = torch.zeros(1, 1, 64, dtype=torch.float16)
for cache_dtype, capability, refused in [
    (torch.float8_e4m3fn, (8, 0), True),
    (torch.float8_e4m3fn, (8, 6), True),
    (torch.float8_e5m2, (8, 0), False),
]:
    cache = torch.zeros(2, 16, 1, 64, dtype=cache_dtype)
    try:
        unified_attention(q, cache, cache, torch.zeros(1, 2, dtype=torch.int32),
                          torch.tensor([0, 1], dtype=torch.int32),
                          torch.tensor([1], dtype=torch.int32), 0.1, None, 1, 1, capability)
    except ValueError as error:
        assert refused, error
        assert "float8_e4m3fn KV caches" in str(error) and "fp8_e5m2" in str(error), error
    except RuntimeError as error:
        # Accepted: the launch got past the dispatcher, to find no GPU to run on.
        assert not refused and "active drivers" in str(error), (cache_dtype, capability, error)
    else:
        assert not refused, (cache_dtype, capability)
"""
