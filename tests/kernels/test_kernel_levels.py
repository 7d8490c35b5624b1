"""The instruction-set levels of the C++ CPU kernels (``pagedllm.kernels.isa``): which level a
CPU gets, how ``$PAGEDLLM_KERNEL_ISA`` names another, and every level this CPU can execute built
and checked against the reference, each in a process of its own (a process loads one build of
the library). So on an AVX-512 CPU the AVX2 and generic paths are tested too, which its own
build leaves out; the levels it cannot execute are compiled only
(``tests/kernels/test_cpu_extension.py``). The terminal summary says which levels ran."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedllm.kernels import cpu_extension, isa

REPO = Path(__file__).resolve().parents[2]
# What each level reruns: every comparison of a C++ kernel with the reference (the decode
# attention over every cache dtype, the KV writes, the layer ops, the quantized matmul, the
# panel matmul in float32 and bfloat16, the decode graph over them).
COMPARISONS = (
    "tests/kernels/test_kernels.py::test_cpu_backend_matches_reference",
    "tests/kernels/test_cpu_kv_cache_8bit.py",
    "tests/kernels/test_layer_ops.py",
    "tests/kernels/test_quant_linear.py",
    "tests/models/test_cpu_linear.py",
    "tests/models/test_decode_graph.py",
)

V4_VNNI = isa.X86_64_V4 | {"avx512_vnni"}
AMX = {"avx512_bf16", "amx_tile", "amx_bf16"}


@pytest.mark.parametrize(
    "flags, level",
    [
        (set(), "generic"),
        ({"avx2", "fma"}, "generic"),  # no BMI2 and F16C: not x86-64-v3
        (isa.X86_64_V3, "avx2"),
        (isa.X86_64_V4, "avx512"),
        (isa.X86_64_V4 | {"avx512_bf16"}, "avx512"),  # BF16 without VNNI: no such CPU
        (V4_VNNI, "avx512-vnni"),
        (V4_VNNI | {"avx512_bf16"}, "avx512-bf16-vnni"),
        (V4_VNNI | {"avx512_bf16", "amx_tile"}, "avx512-bf16-vnni"),
        (V4_VNNI | AMX, "amx"),
    ],
)
def test_a_cpu_gets_the_best_level_it_executes(flags: set[str], level: str) -> None:
    assert isa.best(frozenset(flags)).name == level


def test_the_environment_names_the_level(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(isa.ISA_ENV, raising=False)
    assert isa.chosen() == isa.best(isa.cpu_flags())
    default_dir = cpu_extension.build_dir()
    monkeypatch.setenv(isa.ISA_ENV, "generic")
    assert isa.chosen().name == "generic" and not cpu_extension.has_avx512()
    assert cpu_extension.compiler_flags() == ["-O3", "-fopenmp", "-fopenmp-simd"]
    assert cpu_extension.build_dir() != default_dir  # the levels' builds sit side by side
    monkeypatch.setenv(isa.ISA_ENV, "avx2")
    assert "-march=x86-64-v3" in cpu_extension.compiler_flags()
    monkeypatch.setenv(isa.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="not a kernel level; the levels: amx, avx512-bf16-vnni"):
        isa.chosen()


def test_a_level_the_cpu_cannot_execute_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(isa, "cpu_flags", lambda: isa.X86_64_V3)
    monkeypatch.setenv(isa.ISA_ENV, "avx512")
    with pytest.raises(isa.UnexecutableLevel) as refused:
        cpu_extension.load.__wrapped__()  # load() without its cache: it ran in this process
    assert str(refused.value) == (
        f"{isa.ISA_ENV}=avx512: this CPU cannot execute it (it lacks avx512bw, avx512cd, "
        "avx512dq, avx512f, avx512vl); the levels it can: avx2, generic"
    )


def summary(output: str) -> str:
    """pytest's last line (``12 passed, 3 skipped in 4.56s``) without its decoration."""
    return output.strip().splitlines()[-1].strip("= ")


@pytest.mark.parametrize("name", isa.NAMES)
def test_every_level_the_cpu_executes_matches_the_reference(
    name: str, level_report: dict[str, str]
) -> None:
    level = isa.named(name)
    flags = isa.cpu_flags()
    if not isa.executable(level, flags):
        lacks = ", ".join(isa.missing(level, flags))
        level_report[name] = f"compiled only, this CPU lacks {lacks}"
        pytest.skip(f"{name}: this CPU cannot execute it (it lacks {lacks}); compiled only")
    if level == isa.chosen():
        level_report[name] = "this run's level: the whole suite runs on it"
        return
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", *COMPARISONS],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, isa.ISA_ENV: name},
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    level_report[name] = f"ran: {summary(run.stdout)} ({time.monotonic() - started:.0f} s)"
