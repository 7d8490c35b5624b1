"""Paged-attention kernel benchmark: achieved memory bandwidth beside torch SDPA.

On CUDA, times the Triton paged attention (``pagedllm.kernels.triton_ops``) for decode (one
new token per sequence) and prefill (a whole prompt per sequence) over batch sizes and context
lengths with ``triton.testing.do_bench``, and torch's ``scaled_dot_product_attention`` on the
same K/V gathered into contiguous tensors. Prints the bandwidth each achieves (bytes of K, V,
Q and output moved over time) as a fraction of the device's peak, checks the two outputs
agree, and writes everything as JSON under ``bench/results/``. Without CUDA it says so and
exits 0.

    python bench/kernel_timings.py [--peak-gbps 4800] [--output PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

RESULTS = Path(__file__).resolve().parent / "results"

# Peak HBM bandwidth in GB/s by device name; the first entry found in the name wins, so more
# specific names come first.
PEAK_GBPS = (
    ("GH200", 4900.0),
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),
    ("H800", 3350.0),
    ("H20", 4000.0),
    ("B200", 8000.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
    ("L40", 864.0),
    ("A10G", 600.0),
    ("A10", 600.0),
    ("L4", 300.0),
    ("RTX 4090", 1008.0),
)

# The bar: decode at batch >= 32 and context >= 2048.
TARGET_MIN_BATCH = 32
TARGET_MIN_CONTEXT = 2048
TARGET_PEAK_FRACTION = 0.70

FUSED_SDPA = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (atol, rtol) within which the Triton and SDPA outputs count as agreeing.
AGREEMENT = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (5e-3, 5e-3), torch.float32: (1e-3, 1e-3)}


@dataclass
class Measurement:
    mode: str
    batch: int
    context: int
    kv_splits: int
    bytes_moved: int
    flops: int
    triton_us: float
    sdpa_us: float
    triton_gbps: float
    sdpa_gbps: float
    triton_peak_fraction: float | None
    sdpa_peak_fraction: float | None
    sdpa_kv_heads: str
    max_abs_diff: float
    outputs_agree: bool


def peak_gbps_of(device_name: str) -> float | None:
    for name, gbps in PEAK_GBPS:
        if name in device_name:
            return gbps
    return None


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peak-gbps", type=float, help="peak memory bandwidth (GB/s)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--context-lens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument(
        "--prefill-max-tokens",
        type=int,
        default=65536,
        help="skip prefill cases with more prompt tokens than this (compute grows as L^2)",
    )
    parser.add_argument("--output", type=Path, help="JSON path (default: bench/results/...)")
    return parser.parse_args(argv)


class PagedCache:
    """``batch`` sequences of ``context`` tokens each, in randomly placed blocks."""

    def __init__(self, args: argparse.Namespace, batch: int, context: int):
        dtype, device = DTYPES[args.dtype], torch.device("cuda")
        blocks_per_seq = math.ceil(context / args.block_size)
        num_blocks = batch * blocks_per_seq
        shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
        self.k_cache = torch.randn(shape, dtype=dtype, device=device)
        self.v_cache = torch.randn(shape, dtype=dtype, device=device)
        self.block_tables = (
            torch.randperm(num_blocks, device=device, dtype=torch.int32)
            .view(batch, blocks_per_seq)
            .contiguous()
        )
        self.seq_lens_k = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.batch, self.context = batch, context

    def gathered(self, cache: torch.Tensor) -> torch.Tensor:
        """``[batch, num_kv_heads, context, head_dim]``, contiguous, for SDPA."""
        blocks = cache[self.block_tables.long()]
        tokens = blocks.reshape(self.batch, -1, *cache.shape[2:])[:, : self.context]
        return tokens.transpose(1, 2).contiguous()


def choose_sdpa(q, k, v, is_causal: bool) -> tuple[Callable[[], torch.Tensor], str]:
    """SDPA with grouped KV heads: natively where a fused kernel takes them, else repeated.

    Call under ``sdpa_kernel(FUSED_SDPA)``: the math fallback would materialise every score.
    """
    functional = torch.nn.functional

    def native() -> torch.Tensor:
        return functional.scaled_dot_product_attention(
            q, k, v, is_causal=is_causal, enable_gqa=True
        )

    try:
        native()
        return native, "native"
    except (TypeError, RuntimeError):
        group = q.shape[1] // k.shape[1]
        k_repeated, v_repeated = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

        def repeated() -> torch.Tensor:
            return functional.scaled_dot_product_attention(
                q, k_repeated, v_repeated, is_causal=is_causal
            )

        return repeated, "repeated"


def measure(args: argparse.Namespace, mode: str, batch: int, context: int, peak: float | None):
    import triton

    from pagedllm.kernels import triton_ops
    from pagedllm.kernels.triton_device import multiprocessor_count
    from pagedllm.kernels.unified_attention import choose_num_kv_splits

    dtype, device = DTYPES[args.dtype], torch.device("cuda")
    cache = PagedCache(args, batch, context)
    q_len = 1 if mode == "decode" else context
    num_tokens = batch * q_len
    q = torch.randn(num_tokens, args.num_heads, args.head_dim, dtype=dtype, device=device)
    cu_seqlens_q = torch.arange(0, num_tokens + 1, q_len, dtype=torch.int32, device=device)
    scale = args.head_dim**-0.5

    def run_triton() -> torch.Tensor:
        return triton_ops.paged_attention(
            q,
            cache.k_cache,
            cache.v_cache,
            cache.block_tables,
            cu_seqlens_q,
            cache.seq_lens_k,
            scale,
            max_seqlen_q=q_len,
            max_seqlen_k=context,
        )

    q_sdpa = q.view(batch, q_len, args.num_heads, args.head_dim).transpose(1, 2).contiguous()
    k_sdpa, v_sdpa = cache.gathered(cache.k_cache), cache.gathered(cache.v_cache)
    with sdpa_kernel(FUSED_SDPA):
        # A single query is the last position, so it sees every key: no mask needed.
        run_sdpa, sdpa_kv_heads = choose_sdpa(q_sdpa, k_sdpa, v_sdpa, is_causal=q_len > 1)
        expected = run_sdpa().transpose(1, 2).reshape(num_tokens, args.num_heads, args.head_dim)
        sdpa_ms = triton.testing.do_bench(run_sdpa, return_mode="median")
    actual = run_triton()
    max_abs_diff = (actual.float() - expected.float()).abs().max().item()
    atol, rtol = AGREEMENT[dtype]
    outputs_agree = torch.allclose(actual, expected, atol=atol, rtol=rtol)
    triton_ms = triton.testing.do_bench(run_triton, return_mode="median")

    element = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * element
    q_and_out_bytes = 2 * num_tokens * args.num_heads * args.head_dim * element
    bytes_moved = kv_bytes + q_and_out_bytes
    causal_pairs = batch * (q_len * context - q_len * (q_len - 1) // 2)
    flops = 4 * causal_pairs * args.num_heads * args.head_dim
    triton_gbps = bytes_moved / triton_ms / 1e6
    sdpa_gbps = bytes_moved / sdpa_ms / 1e6
    kv_splits = choose_num_kv_splits(
        batch, args.num_kv_heads, q_len, context, multiprocessor_count(device)
    )
    return Measurement(
        mode=mode,
        batch=batch,
        context=context,
        kv_splits=kv_splits,
        bytes_moved=bytes_moved,
        flops=flops,
        triton_us=triton_ms * 1e3,
        sdpa_us=sdpa_ms * 1e3,
        triton_gbps=triton_gbps,
        sdpa_gbps=sdpa_gbps,
        triton_peak_fraction=triton_gbps / peak if peak else None,
        sdpa_peak_fraction=sdpa_gbps / peak if peak else None,
        sdpa_kv_heads=sdpa_kv_heads,
        max_abs_diff=max_abs_diff,
        outputs_agree=outputs_agree,
    )


def percent(fraction: float | None) -> str:
    return "   n/a" if fraction is None else f"{100 * fraction:5.1f}%"


def print_row(m: Measurement) -> None:
    tflops = m.flops / (m.triton_us * 1e-6) / 1e12
    print(
        f"{m.mode:>7} {m.batch:>5} {m.context:>7} {m.kv_splits:>6}"
        f" {m.triton_us:>10.1f} {m.triton_gbps:>8.0f} {percent(m.triton_peak_fraction)}"
        f" {m.sdpa_us:>10.1f} {m.sdpa_gbps:>8.0f} {percent(m.sdpa_peak_fraction)}"
        f" {m.sdpa_us / m.triton_us:>7.2f}x {tflops:>7.1f}"
        f"  {'ok' if m.outputs_agree else f'MISMATCH {m.max_abs_diff:.3g}'}"
        f"{'' if m.sdpa_kv_heads == 'native' else ' (SDPA on repeated KV heads)'}",
        flush=True,
    )


def targets(measurements: list[Measurement]) -> list[dict]:
    checked = []
    for m in measurements:
        if m.mode != "decode" or m.batch < TARGET_MIN_BATCH or m.context < TARGET_MIN_CONTEXT:
            continue
        fraction_met = (
            m.triton_peak_fraction is not None and m.triton_peak_fraction >= TARGET_PEAK_FRACTION
        )
        checked.append(
            {
                "batch": m.batch,
                "context": m.context,
                "peak_fraction": m.triton_peak_fraction,
                "speedup_over_sdpa": m.sdpa_us / m.triton_us,
                "met": fraction_met and m.triton_us < m.sdpa_us and m.outputs_agree,
            }
        )
    return checked


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/kernel_timings.py: no CUDA device, nothing to benchmark")
        return 0
    import triton

    device_name = torch.cuda.get_device_name()
    peak = args.peak_gbps or peak_gbps_of(device_name)
    print(
        f"{device_name}: peak {f'{peak:.0f} GB/s' if peak else 'unknown (pass --peak-gbps)'};"
        f" torch {torch.__version__}, triton {triton.__version__}; {args.dtype},"
        f" {args.num_heads} heads / {args.num_kv_heads} KV heads, head dim {args.head_dim},"
        f" block size {args.block_size}"
    )
    print(
        f"{'mode':>7} {'batch':>5} {'context':>7} {'splits':>6}"
        f" {'triton_us':>10} {'GB/s':>8} {'peak':>6}"
        f" {'sdpa_us':>10} {'GB/s':>8} {'peak':>6} {'speedup':>8} {'TFLOP/s':>7}  check"
    )
    started = time.monotonic()
    measurements: list[Measurement] = []
    failures: list[dict] = []
    for mode in ("decode", "prefill"):
        for context in args.context_lens:
            for batch in args.batch_sizes:
                if mode == "prefill" and batch * context > args.prefill_max_tokens:
                    continue
                try:
                    measurement = measure(args, mode, batch, context, peak)
                except Exception as error:  # one failing case must not cost the others
                    if not failures:
                        traceback.print_exc()
                    print(f"{mode:>7} {batch:>5} {context:>7}  FAILED: {error!r}", flush=True)
                    failures.append(
                        {"mode": mode, "batch": batch, "context": context, "error": repr(error)}
                    )
                else:
                    print_row(measurement)
                    measurements.append(measurement)
                torch.cuda.empty_cache()

    checked = targets(measurements)
    for target in checked:
        verdict = "met" if target["met"] else "MISSED"
        print(
            f"target decode batch {target['batch']} context {target['context']}:"
            f" {percent(target['peak_fraction']).strip()} of peak"
            f" (>= {TARGET_PEAK_FRACTION:.0%}), {target['speedup_over_sdpa']:.2f}x SDPA: {verdict}"
        )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    slug = device_name.replace("NVIDIA ", "").replace(" ", "-")
    output = args.output or RESULTS / f"kernels-{slug}-{stamp}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "device": device_name,
        "peak_gbps": peak,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "seconds": time.monotonic() - started,
        "measurements": [asdict(m) for m in measurements],
        "targets": checked,
        "failures": failures,
    }
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {output} ({report['seconds']:.0f} s)")
    mismatched = [m for m in measurements if not m.outputs_agree]
    return 1 if failures or mismatched else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
