"""Roofline: the model's matmuls timed alone, and the engine's decode step against them.

A forward pass of a decoder is, in time, mostly its weight matmuls (q/k/v, o, gate/up and down
per layer, then the LM head). Timed alone at a batch's shape, with every layer's own weights so
the memory traffic is the model's, and run as the engine runs them (weights packed for oneDNN
on x86 CPUs, else ``F.linear``), they give the fastest this machine can run that batch:
``batch / matmul_time`` tokens/s. The engine's decode step (schedule, forward, sample) at
the same batch is reported as a fraction of it; its steps and the matmuls of its own weights
are timed in alternation, so that both see the same load on the machine.

The decode step also reads every sequence's KV cache, which the matmuls alone do not count; at
long contexts that read is most of a step. The second roofline adds it: the matmul time plus
the KV bytes a step must read (batch x context x layers x K and V x KV heads x head size, in the
cache's element) at the machine's read bandwidth (a large tensor summed, best of 5). The target
is on that one; the matmul-only share is printed beside it.

    python bench/roofline.py [--model DIR|FILE.gguf|smollm2] [--batch 32] [--context 256]
        [--threads 2] [--kv-cache-dtype auto|int8_per_token_head|fp8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common
import torch
import torch.nn.functional as F

DEFAULT_BATCHES = (1, 8, 16, 32, 64, 128, 256)
TARGET_FRACTION = 0.75


@dataclass
class Matmul:
    name: str
    in_features: int
    out_features: int
    count: int  # how many per forward pass (one per layer, or one)


def model_matmuls(summary: dict[str, Any]) -> list[Matmul]:
    h, hd = summary["hidden_size"], summary["head_dim"]
    heads, kv = summary["heads"], summary["kv_heads"]
    layers = summary["layers"]
    return [
        Matmul("qkv_proj", h, (heads + 2 * kv) * hd, layers),
        Matmul("o_proj", heads * hd, h, layers),
        Matmul("gate_up_proj", h, 2 * summary["intermediate_size"], layers),
        Matmul("down_proj", summary["intermediate_size"], h, layers),
        Matmul("lm_head", h, summary["vocab_size"], 1),
    ]


MatmulFn = Callable[[torch.Tensor], torch.Tensor]


def weight_matmul(weight: torch.Tensor) -> MatmulFn:
    """``x @ weight.T`` the way the engine runs it: with the weight packed for oneDNN where
    the engine packs its weights (``pagedllm.models.cpu_linear``), else ``F.linear``."""
    from pagedllm.models import cpu_linear

    if cpu_linear.available(weight.device, weight.dtype):
        packed = cpu_linear.pack(weight)
        return lambda x: cpu_linear.linear(x, packed, None)
    return lambda x: F.linear(x, weight)


class MatmulTimer:
    """Every weight matrix of the model, to time the matmuls of one forward pass.

    ``weights`` maps each matmul's name to its per-layer matmuls; by default they multiply by
    random matrices of the model's shapes, the way the engine multiplies by its weights.
    """

    def __init__(
        self,
        summary: dict[str, Any],
        dtype: torch.dtype = torch.float32,
        weights: dict[str, list[MatmulFn]] | None = None,
    ) -> None:
        self.matmuls = model_matmuls(summary)
        self.dtype = dtype
        if weights is None:
            generator = torch.Generator().manual_seed(0)
            weights = {
                m.name: [
                    weight_matmul(
                        torch.randn(m.out_features, m.in_features, generator=generator, dtype=dtype)
                    )
                    for _ in range(m.count)
                ]
                for m in self.matmuls
            }
        self.weights = weights

    def flops(self, tokens: int) -> int:
        return sum(2 * tokens * m.in_features * m.out_features * m.count for m in self.matmuls)

    @torch.inference_mode()
    def time(self, tokens: int, repeats: int = 5) -> dict[str, float]:
        """Median seconds of each matmul kind (all its layers) and of the whole pass."""
        inputs = {
            m.name: torch.randn(tokens, m.in_features, dtype=self.dtype) for m in self.matmuls
        }
        samples: dict[str, list[float]] = {m.name: [] for m in self.matmuls}
        for rep in range(repeats + 1):
            for m in self.matmuls:
                x = inputs[m.name]
                t0 = time.perf_counter()
                for matmul in self.weights[m.name]:
                    matmul(x)
                elapsed = time.perf_counter() - t0
                if rep > 0:  # the first pass warms up
                    samples[m.name].append(elapsed)
        per_kind = {name: statistics.median(v) for name, v in samples.items()}
        per_kind["total"] = sum(per_kind.values())
        return per_kind


def roofline_table(timer: MatmulTimer, batches: list[int]) -> list[dict[str, Any]]:
    rows = []
    for batch in batches:
        t = timer.time(batch)
        rows.append(
            {
                "tokens": batch,
                "matmul_s": t["total"],
                "per_matmul_s": {k: v for k, v in t.items() if k != "total"},
                "gflops": timer.flops(batch) / t["total"] / 1e9,
                "tokens_per_s": batch / t["total"],
            }
        )
    return rows


def engine_weights(model: torch.nn.Module) -> dict[str, list[MatmulFn]]:
    """The loaded model's own weight matmuls (packed or not, as it runs them), by name."""
    layers = model.model.layers

    def own(module: torch.nn.Module) -> MatmulFn:
        return lambda x: module.matmul(x, None)

    return {
        "qkv_proj": [own(layer.self_attn.qkv_proj) for layer in layers],
        "o_proj": [own(layer.self_attn.o_proj) for layer in layers],
        "gate_up_proj": [own(layer.mlp.gate_up_proj) for layer in layers],
        "down_proj": [own(layer.mlp.down_proj) for layer in layers],
        "lm_head": [own(model.lm_head)],
    }


def read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second this machine's threads read a large tensor at (its sum, best of)."""
    data = torch.ones(megabytes * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def kv_bytes_per_step(summary: dict[str, Any], batch: int, context: int, element: float) -> float:
    """The KV cache a decode step reads: every sequence's keys and values in every layer."""
    per_token = 2 * summary["layers"] * summary["kv_heads"] * summary["head_dim"] * element
    return batch * context * per_token


def kv_element_bytes(kv_cache_dtype: str, dtype: str, head_dim: int) -> float:
    """Bytes per cached value: the model's dtype, one for 8-bit caches (int8 rows carry a
    2-byte scale per head)."""
    if kv_cache_dtype == "auto":
        return torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return (head_dim + 2) / head_dim if kv_cache_dtype == "int8_per_token_head" else 1.0


def engine_decode_step(
    model_dir: Path,
    summary: dict[str, Any],
    batch: int,
    context: int,
    rounds: int,
    dtype: str = "float32",
    steps_per_round: int = 4,
    kv_cache_dtype: str = "auto",
) -> dict[str, Any]:
    """Median decode step of the engine with ``batch`` sequences at about ``context`` tokens,
    and median matmul time of its own weights at that batch, timed in alternation."""
    from pagedllm import LLM, SamplingParams

    steps = rounds * steps_per_round
    llm = LLM(
        model=str(model_dir),
        dtype=dtype,
        quantization=common.QUANTIZATION,
        max_num_seqs=batch,
        max_model_len=context + steps + 64,
        enable_prefix_caching=False,
        kv_cache_dtype=kv_cache_dtype,
    )
    engine = llm.engine
    timer = MatmulTimer(summary, getattr(torch, dtype), engine_weights(engine.runner.model))
    workload = common.make_workload(
        batch,
        common.vocab_size(model_dir),
        seed=1,
        prompt_len=context,
        prompt_spread=0,
        output_len=steps + 8,
        output_spread=0,
    )
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for prompt in workload.prompts:
        engine.add_request({"prompt_token_ids": prompt}, params)
    while engine.last_step is None or engine.last_step.num_tokens != batch:
        engine.step()
    step_s, execute_s, schedule_s, matmul_s = [], [], [], []
    for _ in range(rounds):
        for _ in range(steps_per_round):
            t0 = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - t0)
            execute_s.append(engine.last_step.execute_s)
            schedule_s.append(engine.last_step.schedule_s)
            assert engine.last_step.num_tokens == batch
        matmul_s.append(timer.time(batch, repeats=1)["total"])
    for request_id in list(engine._states):
        engine.abort_request(request_id)
    return {
        "batch": batch,
        "context": context,
        "steps": len(step_s),
        "step_s": statistics.median(step_s),
        "execute_s": statistics.median(execute_s),
        "schedule_s": statistics.median(schedule_s),
        "matmul_s": statistics.median(matmul_s),
    }


def plot(rows: list[dict[str, Any]], decode: dict[str, Any] | None, name: str) -> Path:
    fig, (ax,) = common.new_figure()
    xs = [r["tokens"] for r in rows]
    ax.plot(xs, [r["tokens_per_s"] for r in rows], "o-", label="roofline: matmuls alone")
    if decode is not None:
        ax.plot(
            [decode["batch"]],
            [decode["batch"] / decode["matmul_s"]],
            "^",
            markersize=9,
            label="roofline: the engine's weights, alternated with its steps",
        )
        ax.plot(
            [decode["batch"]],
            [decode["batch"] / decode["step_s"]],
            "s",
            markersize=9,
            label=f"PagedLLM decode step (batch {decode['batch']})",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per forward pass (decode batch)")
    ax.set_ylabel("tokens/s")
    ax.set_title("Decode throughput bound by the model's matmuls")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return common.save_figure(fig, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", help="model directory, GGUF file or smollm2 (default: the ~100M benchmark model)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=common.DTYPE_CHOICES, default="float32")
    parser.add_argument("--batch", type=int, default=32, help="decode batch of the target")
    parser.add_argument("--context", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument(
        "--rounds", type=int, default=6, help="rounds of 4 decode steps and one matmul pass"
    )
    parser.add_argument("--batches", default=",".join(map(str, DEFAULT_BATCHES)))
    parser.add_argument("--name", default="roofline")
    args = parser.parse_args()

    common.set_threads(args.threads)
    common.warn_if_busy()
    model_dir = common.resolve_model(args.model)
    summary = common.model_summary(model_dir)
    batches = sorted({int(b) for b in args.batches.split(",")} | {args.batch})
    decode = engine_decode_step(
        model_dir,
        summary,
        args.batch,
        args.context,
        args.rounds,
        args.dtype,
        4,
        args.kv_cache_dtype,
    )
    fraction = decode["matmul_s"] / decode["step_s"]
    bandwidth = read_bandwidth()
    element = kv_element_bytes(args.kv_cache_dtype, args.dtype, summary["head_dim"])
    kv_bytes = kv_bytes_per_step(summary, args.batch, args.context + args.rounds * 2, element)
    kv_s = kv_bytes / bandwidth
    kv_fraction = (decode["matmul_s"] + kv_s) / decode["step_s"]
    forward_fraction = decode["matmul_s"] / decode["execute_s"]
    timer = MatmulTimer(summary, getattr(torch, args.dtype))
    rows = roofline_table(timer, batches)
    del timer

    print(f"model: {summary['parameters'] / 1e6:.0f}M parameters, {args.threads} threads")
    common.print_table(
        ["tokens", "matmul ms", "GFLOP/s", "tokens/s bound"],
        [[r["tokens"], r["matmul_s"] * 1e3, r["gflops"], r["tokens_per_s"]] for r in rows],
        title="Matmuls of one forward pass, timed alone (torch, random weights)",
    )
    common.print_table(
        [
            "batch",
            "context",
            "step ms",
            "forward+sample ms",
            "schedule ms",
            "matmul ms",
            "tokens/s",
            "of roofline",
        ],
        [
            [
                args.batch,
                args.context,
                decode["step_s"] * 1e3,
                decode["execute_s"] * 1e3,
                decode["schedule_s"] * 1e3,
                decode["matmul_s"] * 1e3,
                kv_s * 1e3,
                args.batch / decode["step_s"],
                f"{fraction:.0%}",
                f"{kv_fraction:.0%}",
            ]
        ],
        title="PagedLLM decode step and the matmuls of its own weights, alternated",
    )
    print(
        f"KV cache {args.kv_cache_dtype}: {kv_bytes / 2**20:.0f} MiB a step at "
        f"{bandwidth / 1e9:.1f} GB/s read bandwidth"
    )
    targets = [
        common.Target(
            f"decode at batch {args.batch}, context {args.context}, share of the roofline of "
            "its matmuls and KV read",
            kv_fraction,
            TARGET_FRACTION,
            note=f"matmuls alone: {fraction:.0%}; forward and sampling: {forward_fraction:.0%}",
        ),
    ]
    common.print_targets(targets)
    data = {
        "benchmark": "roofline",
        "machine": common.machine_info(),
        "model": summary,
        "matmuls": [m.__dict__ for m in model_matmuls(summary)],
        "roofline": rows,
        "decode": decode
        | {
            "fraction": fraction,
            "forward_fraction": forward_fraction,
            "kv_cache_dtype": args.kv_cache_dtype,
            "kv_bytes": kv_bytes,
            "read_bandwidth": bandwidth,
            "kv_read_s": kv_s,
            "kv_fraction": kv_fraction,
        },
        "targets": [t.to_json() for t in targets],
    }
    path = common.write_json(args.name, data)
    png = plot(rows, decode, args.name)
    print(f"\nwrote {path} and {png}")


if __name__ == "__main__":
    main()
