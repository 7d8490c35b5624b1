"""Ahead-of-time compile check of the Triton kernels for NVIDIA GPUs, without a GPU.

Runs the kernels' own dispatchers (``unified_attention``, ``write_kv``, ``copy_blocks``) on
small CPU tensors for every configuration they can choose, with each kernel's launch
recorded instead of run, then compiles every distinct launch the way Triton's launcher would
(same signature, specialisation and options) for sm_80 (A100), sm_86 (A10G, RTX 30), sm_89
(L4, RTX 40) and sm_90 (H100, H200), and reads registers and spills from ``ptxas -v``.
Triton generates the same PTX for sm_80, sm_86 and sm_89 (checked here once per kernel), so
those three share one Triton compile, each then assembled by ``ptxas`` for its own target;
attention over an 8-bit float cache is the exception (sm_89 converts 8-bit floats in hardware),
compiled for sm_89 on its own. A configuration the dispatcher refuses on a target (a
``float8_e4m3fn`` cache below sm_89) is recorded as refused there, with its message.

Prints one line per configuration class (``--full``: per configuration) with the worst
registers, spill bytes and shared memory on each target, writes every result as JSON
(``--json PATH``), and exits 1 on any compile error, spill, or shared memory above a target's
per-block limit. Results are cached under ``pagedllm.cache.cache_root()/kernels-aot`` by a
hash of the kernel source, its specialisation and options, the target and the Triton version.

    python bench/kernels_aot.py [--full] [--json PATH] [--jobs N]
"""

from __future__ import annotations

import os

# Compile, never interpret: must be set before anything imports triton.
os.environ["TRITON_INTERPRET"] = "0"

import argparse  # noqa: E402
import contextlib  # noqa: E402
import hashlib  # noqa: E402
import importlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from concurrent.futures import ProcessPoolExecutor  # noqa: E402
from dataclasses import asdict, dataclass, field, replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402
from unittest import mock  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from pagedllm.cache import cache_root  # noqa: E402
from pagedllm.kernels import cache_ops, unified_attention  # noqa: E402

# Shared memory one block may use, per target (CUDA programming guide, compute capabilities).
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
TARGETS = tuple(SHARED_LIMIT)
# One Triton compile per family: its first target's PTX is assembled for the others.
FAMILIES = {80: (80, 86, 89), 90: (90,)}
# Attention over 8-bit float caches: sm_89 has the fp8 conversions sm_80 and sm_86 emulate.
FP8_FAMILIES = {80: (80, 86), 89: (89,), 90: (90,)}

HEAD_DIMS = (64, 80, 96, 128, 256)
GROUPS = (1, 2, 4, 8)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# 8-bit float caches, read in the queries' dtype; fewer head sizes (each compile costs a second).
FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_HEAD_DIMS = (64, 128)
# (queries, cache) of the attention configurations: a cache of the queries' dtype, or 8-bit.
ATTENTION_DTYPES = [(d, d) for d in DTYPES] + [(q, c) for c in FP8_CACHE_DTYPES for q in DTYPES]
KV_HEADS = (1, 8)
MODES = ("decode", "decode split-KV", "chunked prefill", "mixed")
# The split count is a run-time value of both split-KV kernels; one stands for all.
NUM_KV_SPLITS = 4
BLOCK_SIZE = 16
NUM_KV_HEADS = 8  # of the attention configurations: query heads = 8 x group
WINDOW = 48

DTYPE_NAMES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "e4m3",
    torch.float8_e5m2: "e5m2",
}
CACHE_DIR = cache_root() / "kernels-aot"


@dataclass(frozen=True)
class Config:
    """One configuration a dispatcher can choose; ``klass`` groups them for the summary.

    ``dtype`` names the activations' dtype, then after a slash an 8-bit cache's ("fp16/e4m3").
    """

    kernel: str
    klass: str
    dtype: str
    head_dim: int
    detail: str = ""


def dtype_label(activations: torch.dtype, cache: torch.dtype) -> str:
    if cache == activations:
        return DTYPE_NAMES[activations]
    return f"{DTYPE_NAMES[activations]}/{DTYPE_NAMES[cache]}"


@dataclass
class Launch:
    config: Config
    module: str
    name: str
    args: tuple
    kwargs: dict
    targets: tuple[int, ...] = ()  # that its compile is assembled for (set per family)


@dataclass
class Refusal:
    """A configuration the dispatcher refuses on a family's targets."""

    config: Config
    targets: tuple[int, ...]
    message: str


@dataclass
class Job:
    """One Triton compile (of one family) of a kernel with one specialisation."""

    module: str
    name: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    family: int
    targets: tuple[int, ...]
    verify_retarget: bool = False

    def key(self) -> str:
        fn = _kernel(self.module, self.name)
        source_hash = ASTSource(fn, self.signature, self.constexprs, self.attrs).hash()
        parts = [triton.__version__, self.family, source_hash, sorted(self.options.items())]
        if self.targets != FAMILIES.get(self.family):
            parts.append(self.targets)
        text = json.dumps(parts, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass
class Result:
    """What one target's compile reports; ``error`` when it failed."""

    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    shared: int = 0
    num_warps: int = 0
    num_stages: int = 0
    error: str = ""
    refused: str = ""  # the dispatcher's message where it refuses the configuration


@dataclass
class Row:
    config: Config
    results: dict[int, Result] = field(default_factory=dict)

    def failures(self) -> list[str]:
        found = []
        for target, result in self.results.items():
            if result.refused:
                continue
            if result.error:
                found.append(f"sm_{target}: compile error: {result.error}")
            elif result.spill_stores or result.spill_loads:
                found.append(
                    f"sm_{target}: spills {result.spill_stores} bytes stored, "
                    f"{result.spill_loads} loaded per thread ({result.registers} registers)"
                )
            elif result.shared > SHARED_LIMIT[target]:
                found.append(
                    f"sm_{target}: {result.shared} bytes of shared memory, above the "
                    f"{SHARED_LIMIT[target]} a block may use"
                )
        return found


def _kernel(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` records the launch."""

    def __init__(self, module: Any, name: str, config: list[Config], sink: list[Launch]):
        self.module, self.name, self.config, self.sink = module.__name__, name, config, sink

    def __getitem__(self, grid: object):
        def launch(*args: object, **kwargs: object) -> None:
            self.sink.append(Launch(self.config[0], self.module, self.name, args, kwargs))

        return launch


@contextlib.contextmanager
def _recording(config: list[Config]) -> Iterator[list[Launch]]:
    launches: list[Launch] = []
    kernels = [
        (unified_attention, "_paged_attention_kernel"),
        (unified_attention, "_merge_kv_splits_kernel"),
        (cache_ops, "_write_kv_kernel"),
        (cache_ops, "_copy_blocks_kernel"),
    ]
    with contextlib.ExitStack() as stack:
        for module, name in kernels:
            recorder = _Recorder(module, name, config, launches)
            stack.enter_context(mock.patch.object(module, name, recorder))
        yield launches


def _attention_batch(
    mode: str, group: int, head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype
):
    """q, caches and the sequence layout of a small batch of ``mode``."""
    q_lens = {
        "decode": [1, 1, 1],
        "decode split-KV": [1, 1, 1],
        "chunked prefill": [37, 64],
        "mixed": [1, 29, 1],
    }[mode]
    kv_lens = [length + 40 for length in q_lens]
    num_heads = NUM_KV_HEADS * group
    blocks_per_seq = triton.cdiv(max(kv_lens), BLOCK_SIZE)
    k_cache = torch.zeros(
        len(q_lens) * blocks_per_seq, BLOCK_SIZE, NUM_KV_HEADS, head_dim, dtype=cache_dtype
    )
    block_tables = torch.arange(k_cache.shape[0], dtype=torch.int32).view(len(q_lens), -1)
    q = torch.zeros(sum(q_lens), num_heads, head_dim, dtype=dtype)
    cu_seqlens_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens_k = torch.tensor(kv_lens, dtype=torch.int32)
    return q, k_cache, block_tables, cu_seqlens_q, seq_lens_k, max(q_lens)


def _supported(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the dispatcher takes this cache (it refuses fp32 above FP32_MAX_HEAD_DIM)."""
    return dtype != torch.float32 or head_dim <= unified_attention.FP32_MAX_HEAD_DIM


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_CACHE_DTYPES


def _attention_launches(
    capability: tuple[int, int], fp8_only: bool = False
) -> tuple[list[Launch], list[Refusal]]:
    """The attention and merge launches the dispatcher chooses for ``capability``, and the
    configurations it refuses there."""
    current: list[Config] = [Config("", "", "", 0)]
    refused: dict[Config, str] = {}
    with _recording(current) as launches:
        for dtype, cache_dtype in ATTENTION_DTYPES:
            if fp8_only and not _is_fp8(cache_dtype):
                continue
            for head_dim in FP8_HEAD_DIMS if _is_fp8(cache_dtype) else HEAD_DIMS:
                for group in GROUPS:
                    for mode in MODES:
                        for window in (None, WINDOW):
                            splits = NUM_KV_SPLITS if mode == "decode split-KV" else 1
                            batch = _attention_batch(mode, group, head_dim, dtype, cache_dtype)
                            q, k_cache, block_tables, cu_seqlens_q, seq_lens_k, max_q = batch
                            detail = f"group {group}" + (", window" if window else "")
                            label = dtype_label(dtype, cache_dtype)
                            current[0] = Config("attention", mode, label, head_dim, detail)
                            if not _supported(dtype, head_dim):
                                continue
                            try:
                                unified_attention.unified_attention(
                                    q, k_cache, k_cache, block_tables, cu_seqlens_q,
                                    seq_lens_k, 0.1, window, max_q, splits, capability,
                                )  # fmt: skip
                            except ValueError as error:
                                if not _is_fp8(cache_dtype):
                                    raise
                                refused[current[0]] = str(error)
    # The merge kernel's launches are classed by themselves, by the activations' dtype (it
    # reads fp32 partial results, whatever the cache): those of 8-bit caches repeat others'.
    merges = [launch for launch in launches if launch.name == "_merge_kv_splits_kernel"]
    for launch in merges:
        dtype = launch.config.dtype.split("/")[0]
        launch.config = Config("split-KV merge", "decode split-KV", dtype, launch.config.head_dim)
    if fp8_only:
        launches = [launch for launch in launches if launch.name != "_merge_kv_splits_kernel"]
    return launches, [Refusal(config, (), message) for config, message in refused.items()]


def _cache_launches() -> list[Launch]:
    current: list[Config] = [Config("", "", "", 0)]
    cache_dtypes = [(d, d, HEAD_DIMS) for d in DTYPES]
    # 8-bit caches, written from activations of every dtype, at fewer head sizes.
    cache_dtypes += [(d, c, FP8_HEAD_DIMS) for c in FP8_CACHE_DTYPES for d in DTYPES]
    with _recording(current) as launches:
        for dtype, cache_dtype, head_dims in cache_dtypes:
            label = dtype_label(dtype, cache_dtype)
            for head_dim in head_dims:
                for kv_heads in KV_HEADS:
                    detail = f"{kv_heads} KV heads"
                    cache = torch.zeros(4, BLOCK_SIZE, kv_heads, head_dim, dtype=cache_dtype)
                    key = torch.zeros(3, kv_heads, head_dim, dtype=dtype)
                    slots = torch.tensor([0, 17, 33])
                    current[0] = Config("KV write", "KV write", label, head_dim, detail)
                    cache_ops.write_kv(key, key, cache, cache, slots)
                    if dtype != cache_dtype and dtype != torch.float16:
                        continue  # one copy per cache dtype: it moves bytes
                    copy_label = DTYPE_NAMES[cache_dtype]
                    current[0] = Config("block copy", "block copy", copy_label, head_dim, detail)
                    cache_ops.copy_blocks([(cache, cache)], torch.tensor([[0, 1]]))
    return launches


def launches_by_target() -> tuple[dict[int, list[Launch]], list[Refusal]]:
    """Every launch the dispatchers choose, for each target family's compute capability, each
    with the targets its compile is assembled for; and the configurations refused."""
    shared = _cache_launches()
    by_family: dict[int, list[Launch]] = {}
    refusals: list[Refusal] = []
    for family in sorted(FAMILIES.keys() | FP8_FAMILIES.keys()):
        fp8_only = family not in FAMILIES
        attention, refused = _attention_launches((family // 10, family % 10), fp8_only)
        for launch in attention:
            fp8 = launch.name == "_paged_attention_kernel" and "/" in launch.config.dtype
            launch.targets = (FP8_FAMILIES if fp8 else FAMILIES)[family]
        if not fp8_only:
            attention += [replace(launch, targets=FAMILIES[family]) for launch in shared]
        by_family[family] = attention
        refusals += [Refusal(r.config, FP8_FAMILIES[family], r.message) for r in refused]
    return by_family, refusals


def _job(launch: Launch, family: int) -> Job:
    """The compile Triton's launcher would make for ``launch`` on ``family``."""
    fn = _kernel(launch.module, launch.name)
    backend = make_backend(GPUTarget("cuda", family, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, launch.kwargs, bound_args, specialization, options
    )
    return Job(
        launch.module,
        launch.name,
        signature,
        constexprs,
        attrs,
        options.__dict__,
        family,
        launch.targets,
    )


PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _ptxas_result(log: str) -> Result:
    registers = PTXAS_REGISTERS.search(log)
    spills = PTXAS_SPILLS.search(log)
    if not registers or not spills:
        return Result(error=f"no register or spill counts in ptxas's output: {log[-500:]!r}")
    return Result(
        registers=int(registers.group(1)),
        spill_stores=int(spills.group(1)),
        spill_loads=int(spills.group(2)),
    )


def _assemble(ptx: str, target: int, fp_fusion: bool) -> Result:
    """``ptxas -v`` on ``ptx`` for ``target``, with the flags Triton's own compile passes."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptx = re.sub(r"^\.target sm_\w+", f".target sm_{target}", ptx, count=1, flags=re.M)
    with tempfile.TemporaryDirectory() as work:
        source = Path(work, "kernel.ptx")
        source.write_text(ptx)
        command = [get_ptxas(target).path, "-lineinfo", "-v", "--regAllocOptLevel=2"]
        command += [] if fp_fusion else ["--fmad=false"]
        command += [f"--gpu-name=sm_{target}", str(source), "-o", str(source.with_suffix(".o"))]
        done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        return Result(error=f"ptxas for sm_{target} failed: {done.stderr[-500:]}")
    return _ptxas_result(done.stderr)


def _triton_compile(job: Job, capability: int) -> tuple[Any, str]:
    """The compiled kernel and ptxas's log."""
    fn = _kernel(job.module, job.name)
    source = ASTSource(fn, job.signature, job.constexprs, job.attrs)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        kernel = triton.compile(
            source, target=GPUTarget("cuda", capability, 32), options=job.options
        )
    return kernel, log.getvalue()


def compile_job(job: Job) -> dict[int, Result]:
    """Results of ``job`` for every target of its family."""
    try:
        kernel, log = _triton_compile(job, job.family)
    except Exception as error:  # noqa: BLE001 - any compile failure is a result to report
        message = f"{type(error).__name__}: {error}".strip()[-800:]
        return {target: Result(error=message) for target in job.targets}
    metadata = kernel.metadata
    ptx = kernel.asm["ptx"]
    results = {job.family: _ptxas_result(log)}
    for target in job.targets[1:]:
        results[target] = _assemble(ptx, target, job.options.get("enable_fp_fusion", True))
        if job.verify_retarget:
            own = _triton_compile(job, target)[0].asm["ptx"]
            if re.sub(r"\.target sm_\w+", "", own) != re.sub(r"\.target sm_\w+", "", ptx):
                results[target].error = (
                    f"Triton's PTX for sm_{target} differs from sm_{job.family}'s: "
                    "this check must compile each target on its own"
                )
    for result in results.values():
        result.shared, result.num_warps = metadata.shared, metadata.num_warps
        result.num_stages = metadata.num_stages
    return results


def _worker_init(triton_cache: str) -> None:
    # Triton's own cache would skip ptxas and with it the register and spill counts.
    triton.knobs.cache.dir = triton_cache
    triton.knobs.compilation.always_compile = True
    triton.knobs.nvidia.dump_ptxas_log = True


def _cached(key: str) -> dict[int, Result] | None:
    path = CACHE_DIR / f"{key}.json"
    if not path.exists():
        return None
    try:
        return {
            int(target): Result(**result) for target, result in json.loads(path.read_text()).items()
        }
    except (ValueError, TypeError):
        return None


def _store(key: str, results: dict[int, Result]) -> None:
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    temporary = CACHE_DIR / f"{key}.{os.getpid()}.tmp"
    temporary.write_text(json.dumps({target: asdict(result) for target, result in results.items()}))
    temporary.replace(CACHE_DIR / f"{key}.json")


def run_check(jobs: int) -> list[Row]:
    rows: dict[Config, Row] = {}
    pending: dict[str, Job] = {}
    wanted: list[tuple[Config, str]] = []
    verified: set[tuple[str, tuple[int, ...]]] = set()
    by_family, refusals = launches_by_target()
    for family, launches in by_family.items():
        for launch in launches:
            job = _job(launch, family)
            key = job.key()
            if len(job.targets) > 1 and (launch.name, job.targets) not in verified:
                job.verify_retarget = True
                verified.add((launch.name, job.targets))
                key = job.key() + "-verified"
            wanted.append((launch.config, key))
            pending.setdefault(key, job)
    results = {key: cached for key in pending if (cached := _cached(key)) is not None}
    todo = {key: job for key, job in pending.items() if key not in results}
    print(
        f"{len(wanted)} launches, {len(pending)} distinct compiles, "
        f"{len(results)} cached, {len(todo)} to compile",
        file=sys.stderr,
        flush=True,
    )
    if todo:
        with (
            tempfile.TemporaryDirectory() as triton_cache,
            ProcessPoolExecutor(
                max_workers=max(1, min(jobs, len(todo))),
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_worker_init,
                initargs=(triton_cache,),
            ) as pool,
        ):
            for key, compiled in zip(todo, pool.map(compile_job, todo.values()), strict=True):
                results[key] = compiled
                if not any(result.error for result in compiled.values()):
                    _store(key, compiled)
    for config, key in wanted:
        rows.setdefault(config, Row(config)).results.update(results[key])
    for refusal in refusals:
        for target in refusal.targets:
            rows.setdefault(refusal.config, Row(refusal.config)).results[target] = Result(
                refused=refusal.message
            )
    return list(rows.values())


def _cell(results: list[Result]) -> str:
    if any(result.error for result in results):
        return "ERROR"
    results = [result for result in results if not result.refused]
    if not results:
        return "refused"
    registers = max(result.registers for result in results)
    spills = max(max(result.spill_stores, result.spill_loads) for result in results)
    shared = max(result.shared for result in results)
    return f"{registers} / {spills} / {shared / 1024:.0f}"


def _launch_shape(results: list[Result]) -> list[str]:
    """The warps and the pipeline stages used, each as "a/b" where they vary."""
    results = [result for result in results if not result.refused]
    warps = sorted({result.num_warps for result in results})
    stages = sorted({result.num_stages for result in results})
    return ["/".join(map(str, warps)), "/".join(map(str, stages))]


def _kernel_label(config: Config) -> str:
    """The kernel, and an 8-bit cache's format where it has one ("attention, e4m3 cache")."""
    cache = config.dtype.split("/")[-1]
    if cache in (DTYPE_NAMES[dtype] for dtype in FP8_CACHE_DTYPES):
        return f"{config.kernel}, {cache} cache"
    return config.kernel


def _table_order(keys: list[tuple]):
    """Attention (and merge) classes before the cache kernels', a cache's dtype's before an
    8-bit cache's, each in the order the dispatchers chose them."""

    def order(item: tuple) -> tuple:
        label = item[0][0]
        kernel, _, cache = label.partition(", ")
        return (kernel in ("KV write", "block copy"), cache, keys.index(item[0]))

    return order


def table(rows: list[Row], full: bool) -> str:
    """Markdown: per configuration class (or configuration), per target, the worst
    registers / spill bytes per thread / shared KiB per block."""
    groups: dict[tuple, list[Row]] = {}
    for row in rows:
        config = row.config
        key = (_kernel_label(config), config.klass, config.head_dim)
        if full:
            key += (config.dtype, config.detail)
        groups.setdefault(key, []).append(row)
    head = ["kernel", "batch", "head size"] + (["dtype", "configuration"] if full else [])
    head += ["configs", "warps", "stages"] + [f"sm_{target}" for target in TARGETS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, members in sorted(groups.items(), key=_table_order(list(groups))):
        everything = [result for row in members for result in row.results.values()]
        cells = [str(part) for part in key] + [str(len(members)), *_launch_shape(everything)]
        for target in TARGETS:
            cells.append(_cell([row.results[target] for row in members]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="one line per configuration")
    parser.add_argument("--json", type=Path, help="write every result here")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    args = parser.parse_args(argv)
    rows = run_check(args.jobs)
    print(f"triton {triton.__version__}; cells: registers / spill bytes per thread / shared KiB")
    print(table(rows, args.full))
    if args.json:
        records = [
            {
                "config": asdict(row.config),
                "results": {target: asdict(result) for target, result in row.results.items()},
                "failures": row.failures(),
            }
            for row in rows
        ]
        args.json.write_text(json.dumps({"triton": triton.__version__, "rows": records}, indent=1))
    failing = [(row.config, failure) for row in rows for failure in row.failures()]
    for config, failure in failing:
        print(f"FAIL {config}: {failure}", file=sys.stderr)
    print(f"{len(rows)} configurations, {len(failing)} failures", file=sys.stderr)
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
