"""Memory: KV-cache waste, concurrency, sharing in parallel sampling and beams, prefix caching.

(a) At one fixed KV budget the engine serves the throughput workload (all requests queued at
    once); after every step the share of allocated KV slots holding no token is sampled. The
    traditional scheme, which reserves ``max_model_len`` contiguous slots per sequence when it
    is admitted, is simulated exactly on the same trace and budget (first-fit over one slot
    range), as is the same scheme when each sequence reserves exactly its final length
    ("oracle").
(b) The largest number of sequences each scheme held at once.
(c) Parallel sampling (n=4) and beam search (width 4) on the same workload: blocks held with
    sharing (the engine's pool) against the blocks the same sequences would hold each on its
    own, summed over steps.
(d) A 1,024-token system prompt shared by every request, requests sent one at a time:
    prefill tokens computed and time to first token, with and without prefix caching.

(a)-(c) count slots and blocks, which depend neither on the weights nor on the speed: they run
the small demo model on one thread. (d) times prefills and runs the ~100M benchmark model.

    python bench/memory.py [--num-requests 100] [--kv-tokens 8192] [--parts a,c,d]
"""

from __future__ import annotations

import argparse
import bisect
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common

TARGET_WASTE = 0.04
TARGET_CONCURRENCY = 2.5
TARGET_SAMPLING_SHARE = 0.60
TARGET_BEAM_SHARE = 0.50
TARGET_PREFILL_CUT = 0.90
TARGET_TTFT_SPEEDUP = 5.0


def demo_model() -> Path:
    from pagedllm.models.demo import demo_model_dir

    return demo_model_dir()


def make_llm(model_dir: Path, kv_tokens: int, max_model_len: int, **kwargs: Any):
    from pagedllm import LLM

    return LLM(
        model=str(model_dir),
        dtype="float32",
        quantization=common.QUANTIZATION,
        block_size=16,
        kv_cache_memory=kv_tokens * common.kv_bytes_per_token(model_dir),
        max_model_len=max_model_len,
        **kwargs,
    )


def live_seqs(scheduler) -> list:
    from pagedllm.core.sequence import SequenceStatus

    return [s for s in scheduler.running if s.status == SequenceStatus.RUNNING]


def filled_slots(seqs: list, block_size: int) -> tuple[int, int]:
    """(distinct blocks held, tokens with K/V in them) over the given sequences."""
    return filled_tables([(s.num_kv_tokens, s.blocks.ids) for s in seqs], block_size)


def filled_tables(tables: list[tuple[int, list[int]]], block_size: int) -> tuple[int, int]:
    """(distinct blocks held, tokens with K/V in them) over block tables given as (tokens
    with K/V, block ids); a block in several tables counts once, with its most tokens."""
    filled: dict[int, int] = {}
    for kv, ids in tables:
        for i, block in enumerate(ids):
            n = max(0, min(block_size, kv - i * block_size))
            filled[block] = max(filled.get(block, 0), n)
    return len(filled), sum(filled.values())


# ----- (a) and (b): waste and concurrency ----------------------------------------------------


def run_paged_trace(workload: common.Workload, kv_tokens: int, max_model_len: int) -> dict:
    from pagedllm import SamplingParams

    llm = make_llm(demo_model(), kv_tokens, max_model_len, enable_prefix_caching=False)
    engine = llm.engine
    scheduler = engine.scheduler
    pool = scheduler.block_manager.pool
    bs = scheduler.block_manager.block_size
    for prompt, n in zip(workload.prompts, workload.output_lens, strict=True):
        engine.add_request(
            {"prompt_token_ids": prompt},
            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
        )
    waste, running, used = [], [], []
    while engine.has_unfinished_requests():
        engine.step()
        seqs = live_seqs(scheduler)
        blocks, tokens = filled_slots(seqs, bs)
        if blocks:
            assert blocks == pool.num_used
            waste.append(1 - tokens / (blocks * bs))
            running.append(len(seqs))
            used.append(blocks * bs / (pool.num_blocks * bs))
    return {
        "scheme": "paged",
        "num_blocks": pool.num_blocks,
        "budget_tokens": pool.num_blocks * bs,
        "steps": len(waste),
        "waste_mean": statistics.fmean(waste),
        "waste_max": max(waste),
        "max_concurrent": max(running),
        "mean_concurrent": statistics.fmean(running),
        "budget_used_mean": statistics.fmean(used),
        "num_preemptions": engine.stats().num_preemptions,
        "series": {"waste": waste, "running": running},
    }


class FirstFit:
    """Contiguous allocation over ``[0, size)``: the lowest free range that fits."""

    def __init__(self, size: int) -> None:
        self.starts = [0]
        self.ends = [size]

    def allocate(self, n: int) -> int | None:
        for i, (start, end) in enumerate(zip(self.starts, self.ends, strict=True)):
            if end - start >= n:
                if end - start == n:
                    del self.starts[i], self.ends[i]
                else:
                    self.starts[i] = start + n
                return start
        return None

    def free(self, start: int, n: int) -> None:
        i = bisect.bisect_left(self.starts, start)
        self.starts.insert(i, start)
        self.ends.insert(i, start + n)
        if i + 1 < len(self.starts) and self.ends[i] == self.starts[i + 1]:
            self.ends[i] = self.ends.pop(i + 1)
            del self.starts[i + 1]
        if i > 0 and self.ends[i - 1] == self.starts[i]:
            self.ends[i - 1] = self.ends.pop(i)
            del self.starts[i]


def simulate_contiguous(
    workload: common.Workload, budget: int, max_model_len: int, oracle: bool = False
) -> dict:
    """The traditional scheme on the same trace: FCFS admission of whole sequences, each
    reserving a contiguous range (``max_model_len``, or with ``oracle`` its final length)
    for its life; a step prefills the admitted prompts and decodes one token of the others."""
    allocator = FirstFit(budget)
    queue = list(range(len(workload.prompts)))
    queue.reverse()
    running: dict[int, tuple[int, int, int]] = {}  # request -> (start, size, tokens sampled)
    waste, concurrent, external = [], [], []
    while queue or running:
        for r, (start, size, done) in list(running.items()):
            if done == workload.output_lens[r]:
                allocator.free(start, size)
                del running[r]
            else:
                running[r] = (start, size, done + 1)
        while queue:
            r = queue[-1]
            size = len(workload.prompts[r]) + workload.output_lens[r] if oracle else max_model_len
            start = allocator.allocate(size)
            if start is None:
                break
            queue.pop()
            running[r] = (start, size, 1)
        if not running and not queue:
            break
        if not running:
            raise ValueError("a request does not fit in the KV budget on its own")
        reserved = sum(size for _, size, _ in running.values())
        tokens = sum(len(workload.prompts[r]) + done - 1 for r, (_, _, done) in running.items())
        waste.append(1 - tokens / reserved)
        concurrent.append(len(running))
        free = sum(e - s for s, e in zip(allocator.starts, allocator.ends, strict=True))
        external.append(free / budget)
    return {
        "scheme": "contiguous, oracle length" if oracle else "contiguous, max_model_len",
        "budget_tokens": budget,
        "reservation": "prompt + output" if oracle else max_model_len,
        "steps": len(waste),
        "waste_mean": statistics.fmean(waste),
        "waste_max": max(waste),
        "max_concurrent": max(concurrent),
        "mean_concurrent": statistics.fmean(concurrent),
        "free_unusable_mean": statistics.fmean(external),
        "series": {"waste": waste, "running": concurrent},
    }


# ----- (c): sharing in parallel sampling and beam search -------------------------------------


def run_sharing(workload: common.Workload, kind: str, width: int, max_model_len: int) -> dict:
    from pagedllm import BeamSearchParams, SamplingParams

    kv_tokens = width * sum(
        len(p) + n + 32 for p, n in zip(workload.prompts, workload.output_lens, strict=True)
    )
    llm = make_llm(
        demo_model(),
        kv_tokens,
        max_model_len,
        enable_prefix_caching=False,
        max_num_seqs=width * len(workload.prompts),
    )
    engine = llm.engine
    scheduler = engine.scheduler
    bs = scheduler.block_manager.block_size
    for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens, strict=True)):
        if kind == "beam":
            params = BeamSearchParams(
                beam_width=width, max_tokens=n, ignore_eos=True
            ).to_sampling_params()
        else:
            params = SamplingParams(n=width, temperature=1.0, seed=i, max_tokens=n, ignore_eos=True)
        engine.add_request({"prompt_token_ids": prompt}, params)
    shared_sum = unshared_sum = 0
    shared_series, unshared_series = [], []
    while engine.has_unfinished_requests():
        engine.step()
        seqs = live_seqs(scheduler)
        shared = len({b for s in seqs for b in s.blocks.ids})
        unshared = sum(len(s.blocks.ids) for s in seqs)
        shared_sum += shared
        unshared_sum += unshared
        shared_series.append(shared)
        unshared_series.append(unshared)
    return {
        "kind": kind,
        "width": width,
        "num_requests": len(workload.prompts),
        "block_size": bs,
        "steps": len(shared_series),
        "shared_block_steps": shared_sum,
        "unshared_block_steps": unshared_sum,
        "share": shared_sum / unshared_sum,
        "peak_shared": max(shared_series),
        "peak_unshared": max(unshared_series),
        "num_preemptions": engine.stats().num_preemptions,
        "series": {"shared": shared_series, "unshared": unshared_series},
    }


# ----- (d): prefix caching -------------------------------------------------------------------


@dataclass
class PrefixRun:
    caching: bool
    ttft_s: list[float]
    prefill_tokens: list[int]


def run_prefix(
    model_dir: Path, system_len: int, num_requests: int, seed: int, caching: bool
) -> PrefixRun:
    import random

    from pagedllm import SamplingParams

    rng = random.Random(seed)
    vocab = common.vocab_size(model_dir)
    system = [rng.randrange(common.FIRST_PLAIN_TOKEN, vocab) for _ in range(system_len)]
    users = [
        [rng.randrange(common.FIRST_PLAIN_TOKEN, vocab) for _ in range(rng.randint(16, 64))]
        for _ in range(num_requests)
    ]
    llm = make_llm(
        model_dir, 4 * (system_len + 128), system_len + 256, enable_prefix_caching=caching
    )
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    warm = [rng.randrange(common.FIRST_PLAIN_TOKEN, vocab) for _ in range(32)]
    llm.generate([{"prompt_token_ids": warm}], params, use_tqdm=False)
    ttft, prefill = [], []
    for user in users:
        before = engine.stats()
        computed = 0
        start = time.perf_counter()
        engine.add_request({"prompt_token_ids": system + user}, params)
        first = None
        while first is None:
            for out in engine.step():
                if out.outputs and out.outputs[0].token_ids:
                    first = time.perf_counter() - start
            computed += engine.last_step.num_tokens
        while engine.has_unfinished_requests():
            engine.step()
        after = engine.stats()
        assert after.prompt_tokens - before.prompt_tokens == len(system) + len(user)
        ttft.append(first)
        prefill.append(computed)
    return PrefixRun(caching, ttft, prefill)


# ----- output --------------------------------------------------------------------------------


def plot(data: dict[str, Any], name: str) -> Path:
    fig, axes = common.new_figure(ncols=3, width=5.0)
    if "waste" in data:
        ax = axes[0]
        for run in data["waste"]["runs"]:
            ax.plot([100 * w for w in run["series"]["waste"]], label=run["scheme"])
        ax.set_xlabel("step")
        ax.set_ylabel("allocated KV slots holding no token (%)")
        ax.set_title(f"KV waste at {data['waste']['budget_tokens']} slots")
        ax.legend(fontsize=8)
        ax = axes[1]
        for run in data["waste"]["runs"]:
            ax.plot(run["series"]["running"], label=run["scheme"])
        ax.set_xlabel("step")
        ax.set_ylabel("sequences held at once")
        ax.set_title("Concurrency at the same budget")
        ax.legend(fontsize=8)
    ax = axes[2]
    labels, values, colors = [], [], []
    for run in data.get("sharing", []):
        labels.append(f"{run['kind']} ×{run['width']}\nblocks vs unshared")
        values.append(100 * run["share"])
        colors.append("tab:blue")
    if "prefix" in data:
        p = data["prefix"]
        labels.append("prefix cache\nprefill tokens")
        values.append(100 * (1 - p["prefill_cut"]))
        colors.append("tab:green")
        labels.append("prefix cache\nTTFT")
        values.append(100 / p["ttft_speedup"])
        colors.append("tab:green")
    if labels:
        bars = ax.bar(labels, values, color=colors)
        for bar, v in zip(bars, values, strict=True):
            ax.annotate(
                f"{v:.0f}%", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom"
            )
        ax.axhline(100, color="grey", lw=0.8)
        ax.set_ylabel("% of the unshared / uncached cost")
        ax.set_title("Sharing and prefix caching")
        ax.tick_params(axis="x", labelsize=8)
    return common.save_figure(fig, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="a,c,d", help="a (waste and concurrency), c, d")
    parser.add_argument("--num-requests", type=int, default=100, help="requests of (a)")
    parser.add_argument("--kv-tokens", type=int, default=8192, help="KV budget of (a), tokens")
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=1024,
        help="max_model_len, which the traditional scheme reserves",
    )
    parser.add_argument("--sharing-requests", type=int, default=8, help="requests of (c)")
    parser.add_argument("--width", type=int, default=4, help="n and beam width of (c)")
    parser.add_argument(
        "--prefix-model",
        help="model of (d): directory, GGUF file or smollm2 (default: the benchmark model)",
    )
    parser.add_argument("--system-len", type=int, default=1024)
    parser.add_argument("--prefix-requests", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of (d)")
    parser.add_argument("--name", default="memory")
    args = parser.parse_args()

    parts = {p.strip() for p in args.parts.split(",")}
    common.set_threads(1)
    common.warn_if_busy()
    demo_vocab = common.vocab_size(demo_model())
    data: dict[str, Any] = {"benchmark": "memory", "machine": common.machine_info()}
    targets: list[common.Target] = []

    if "a" in parts:
        workload = common.make_workload(args.num_requests, demo_vocab, args.seed)
        print(
            f"(a) {args.num_requests} requests at a budget of {args.kv_tokens} KV slots ...",
            flush=True,
        )
        paged = run_paged_trace(workload, args.kv_tokens, args.max_model_len)
        budget = paged["budget_tokens"]
        runs = [
            paged,
            simulate_contiguous(workload, budget, args.max_model_len),
            simulate_contiguous(workload, budget, args.max_model_len, oracle=True),
        ]
        common.print_table(
            ["scheme", "waste mean", "waste max", "max seqs", "mean seqs", "steps", "preemptions"],
            [
                [
                    r["scheme"],
                    f"{r['waste_mean']:.1%}",
                    f"{r['waste_max']:.1%}",
                    r["max_concurrent"],
                    r["mean_concurrent"],
                    r["steps"],
                    r.get("num_preemptions", 0),
                ]
                for r in runs
            ],
            title=f"(a, b) KV slots allocated but holding no token; sequences at once "
            f"(budget {budget} slots, max_model_len {args.max_model_len})",
        )
        data["waste"] = {
            "budget_tokens": budget,
            "max_model_len": args.max_model_len,
            "workload": workload.spec | {"seed": args.seed},
            "runs": runs,
        }
        baseline = runs[1]
        targets += [
            common.Target(
                "KV waste share (paged)",
                paged["waste_mean"],
                TARGET_WASTE,
                at_most=True,
                note=f"traditional max-length scheme: {baseline['waste_mean']:.1%}",
            ),
            common.Target(
                "sequences at once vs the traditional scheme",
                paged["max_concurrent"] / baseline["max_concurrent"],
                TARGET_CONCURRENCY,
                unit="×",
                note=f"{paged['max_concurrent']} vs {baseline['max_concurrent']}; "
                f"mean {paged['mean_concurrent']:.1f} vs "
                f"{baseline['mean_concurrent']:.1f}",
            ),
        ]

    if "c" in parts:
        workload = common.make_workload(args.sharing_requests, demo_vocab, args.seed + 1)
        sharing = []
        for kind in ("sampling", "beam"):
            print(
                f"(c) {kind}, width {args.width}, {args.sharing_requests} requests ...", flush=True
            )
            sharing.append(run_sharing(workload, kind, args.width, args.max_model_len))
        common.print_table(
            [
                "kind",
                "width",
                "block-steps shared",
                "unshared",
                "share",
                "peak shared",
                "peak unshared",
            ],
            [
                [
                    r["kind"],
                    r["width"],
                    r["shared_block_steps"],
                    r["unshared_block_steps"],
                    f"{r['share']:.1%}",
                    r["peak_shared"],
                    r["peak_unshared"],
                ]
                for r in sharing
            ],
            title="(c) KV blocks held with sharing vs each sequence on its own (summed over steps)",
        )
        data["sharing"] = sharing
        targets += [
            common.Target(
                f"parallel sampling n={args.width}: blocks vs unshared",
                sharing[0]["share"],
                TARGET_SAMPLING_SHARE,
                at_most=True,
            ),
            common.Target(
                f"beam search width {args.width}: blocks vs unshared",
                sharing[1]["share"],
                TARGET_BEAM_SHARE,
                at_most=True,
            ),
        ]

    if "d" in parts:
        common.set_threads(args.threads)
        model_dir = common.resolve_model(args.prefix_model)
        print(
            f"(d) {args.prefix_requests} requests with a {args.system_len}-token system "
            "prompt, one at a time ...",
            flush=True,
        )
        runs = {
            c: run_prefix(model_dir, args.system_len, args.prefix_requests, args.seed, c)
            for c in (False, True)
        }
        off, on = runs[False], runs[True]
        # From the second request on the system prompt is in the cache.
        cut = 1 - sum(on.prefill_tokens[1:]) / sum(off.prefill_tokens[1:])
        cut_all = 1 - sum(on.prefill_tokens) / sum(off.prefill_tokens)
        ttft_off = statistics.median(off.ttft_s[1:])
        ttft_on = statistics.median(on.ttft_s[1:])
        common.print_table(
            [
                "prefix caching",
                "prefill tokens (first)",
                "prefill tokens (rest, mean)",
                "TTFT first ms",
                "TTFT rest p50 ms",
            ],
            [
                [
                    label,
                    r.prefill_tokens[0],
                    statistics.fmean(r.prefill_tokens[1:]),
                    r.ttft_s[0] * 1e3,
                    statistics.median(r.ttft_s[1:]) * 1e3,
                ]
                for label, r in (("off", off), ("on", on))
            ],
            title=f"(d) {args.system_len}-token shared system prompt, "
            f"{common.model_summary(model_dir)['parameters'] / 1e6:.0f}M model",
        )
        print(
            f"prefill tokens cut over all {args.prefix_requests} requests, the first "
            f"included: {cut_all:.1%}"
        )
        data["prefix"] = {
            "model": common.model_summary(model_dir),
            "system_len": args.system_len,
            "runs": {"off": off.__dict__, "on": on.__dict__},
            "prefill_cut": cut,
            "prefill_cut_all": cut_all,
            "ttft_speedup": ttft_off / ttft_on,
        }
        targets += [
            common.Target(
                "prefix caching: prefill tokens cut (cached system prompt)",
                cut,
                TARGET_PREFILL_CUT,
                note=f"first request included: {cut_all:.1%}",
            ),
            common.Target(
                "prefix caching: TTFT speed-up (p50)",
                ttft_off / ttft_on,
                TARGET_TTFT_SPEEDUP,
                unit="×",
            ),
        ]

    common.print_targets(targets)
    data["targets"] = [t.to_json() for t in targets]
    path = common.write_json(args.name, data)
    png = plot(data, args.name)
    print(f"\nwrote {path} and {png}")


if __name__ == "__main__":
    main()
