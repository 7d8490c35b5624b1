"""The instruction-set levels the C++ CPU kernels are built for, best first, and which of them
this CPU can execute.

A level is a set of compiler flags and the ``/proc/cpuinfo`` flags a CPU needs to run what
they produce. The x86-64 levels (v4: AVX-512, v3: AVX2 and FMA) are portable across a
generation of servers, unlike ``-march=native``. Two AVX-512 extensions have paths of their
own in the sources, each a level above plain AVX-512 so that both sides of its ``#if`` are
built and tested on a CPU that has it: VNNI (the quantized matmul's integer products) and BF16
(its bfloat16 GEMM at prompt row counts, the panel matmul's bfloat16 products). No CPU has BF16
without VNNI, so BF16 comes only with VNNI; AMX (tile products, on top of both) is the top.

``$PAGEDLLM_KERNEL_ISA`` names the level to build; unset, the best one the CPU can execute.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from functools import cache

ISA_ENV = "PAGEDLLM_KERNEL_ISA"

# x86-64-v3's features that decide whether its code runs (the rest come with every AVX2 CPU).
X86_64_V3 = frozenset({"avx2", "fma", "bmi2", "f16c"})
AVX512 = frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})
X86_64_V4 = X86_64_V3 | AVX512
V4 = ("-march=x86-64-v4",)


@dataclass(frozen=True)
class Level:
    """``flags``: what the compiler is given; ``needs``: the CPU flags its code executes on."""

    name: str
    flags: tuple[str, ...]
    needs: frozenset[str]

    @property
    def avx512(self) -> bool:
        """Whether the level builds the AVX-512 code (what the panel matmul needs)."""
        return V4[0] in self.flags


LEVELS = (
    Level(
        "amx",
        (*V4, "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
        X86_64_V4 | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"},
    ),
    Level(
        "avx512-bf16-vnni",
        (*V4, "-mavx512vnni", "-mavx512bf16"),
        X86_64_V4 | {"avx512_vnni", "avx512_bf16"},
    ),
    Level("avx512-vnni", (*V4, "-mavx512vnni"), X86_64_V4 | {"avx512_vnni"}),
    Level("avx512", V4, X86_64_V4),
    Level("avx2", ("-march=x86-64-v3",), X86_64_V3),
    Level("generic", (), frozenset()),
)
NAMES = tuple(level.name for level in LEVELS)


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's flags (``/proc/cpuinfo``; none on an x86 machine that does not say them)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return frozenset()  # the x86 levels' flags mean nothing elsewhere
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def executable(level: Level, flags: frozenset[str]) -> bool:
    return level.needs <= flags


def missing(level: Level, flags: frozenset[str]) -> list[str]:
    return sorted(level.needs - flags)


def best(flags: frozenset[str]) -> Level:
    """The first level (the best) a CPU of ``flags`` can execute; ``generic`` runs anywhere."""
    return next(level for level in LEVELS if executable(level, flags))


def named(name: str) -> Level:
    for level in LEVELS:
        if level.name == name:
            return level
    raise ValueError(f"{ISA_ENV}={name!r}: not a kernel level; the levels: {', '.join(NAMES)}")


def chosen() -> Level:
    """The level ``$PAGEDLLM_KERNEL_ISA`` names, else the best this CPU can execute."""
    name = os.environ.get(ISA_ENV)
    return named(name) if name else best(cpu_flags())


class UnexecutableLevel(RuntimeError):
    """The kernels were asked for a level whose instructions this CPU does not have."""


def check_executable(level: Level) -> None:
    """Refuse ``level`` where this CPU cannot run it: a library built for it would stop the
    process with an illegal instruction at its first call."""
    flags = cpu_flags()
    if not executable(level, flags):
        runs = [other.name for other in LEVELS if executable(other, flags)]
        raise UnexecutableLevel(
            f"{ISA_ENV}={level.name}: this CPU cannot execute it (it lacks "
            f"{', '.join(missing(level, flags))}); the levels it can: {', '.join(runs)}"
        )
