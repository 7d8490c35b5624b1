"""KV waste as a running node reports it: ``bench/memory.py``'s trace (a) replayed through a real
``pagedllm serve``, ``pagedllm:kv_cache_waste_perc`` read live from ``/metrics``, and checked
against this benchmark's own count.

The node gets (a)'s KV budget, block size, ``max_model_len`` and dtype, prefix caching off; all
requests are sent at once (greedy, EOS ignored, (a)'s output lengths). While they run, this
script samples ``/metrics`` and reads the block map's feed (``GET /kv/events``), whose block
tables it counts itself (slots allocated over tokens with K/V in them, a shared block once, as
``memory.py`` counts the in-process engine's). Reported: the metric's mean over the run, the
own count's mean over the maps, how many maps carry exactly the waste the own count finds, and
(a)'s in-process mean from ``bench/results/memory.json`` when it is there. Target: the metric
averages at most 4 %, and agrees with the own count.

    python bench/memory_serve.py [--num-requests 100] [--kv-tokens 8192]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import tempfile
import threading
import time
from array import array
from pathlib import Path
from typing import Any

import common
import httpx
from ipc import Node
from memory import TARGET_WASTE, demo_model, filled_tables

WASTE = "pagedllm:kv_cache_waste_perc"
# How often /metrics is read while the trace runs.
SAMPLE_S = 0.05
# The metric's mean and the own count's may differ by this much (they are sampled at different
# moments of the same run).
TARGET_AGREEMENT = 0.01


def ids(b64: str) -> list[int]:
    values = array("i")
    values.frombytes(base64.b64decode(b64))
    return values.tolist()


class MapReader:
    """Reads the block map's feed in a thread; keeps each map's own count and its figure."""

    def __init__(self, url: str) -> None:
        self.url = f"{url}/kv/events"
        self.rows: list[dict[str, float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with httpx.stream("GET", self.url, timeout=60) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if self.stop.is_set():
                    return
                if line.startswith("data: "):
                    self._take(json.loads(line.removeprefix("data: ")))

    def _take(self, m: dict[str, Any]) -> None:
        bs = m["block_size"]
        blocks, tokens = filled_tables([(s["tokens"], ids(s["blocks"])) for s in m["seqs"]], bs)
        if blocks == 0:
            return
        self.rows.append(
            {
                "t": time.monotonic(),
                "own": 1 - tokens / (blocks * bs),
                "map": m["waste_slots"] / (m["num_used"] * bs),
                "agree": float(
                    blocks * bs - tokens == m["waste_slots"] and blocks == m["num_used"]
                ),
            }
        )


def metric(http: httpx.Client) -> tuple[float, float]:
    """(waste, usage) as /metrics says now."""
    values = {}
    for line in http.get("/metrics").text.splitlines():
        for name in (WASTE, "vllm:kv_cache_usage_perc"):
            if line.startswith(name + "{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values[WASTE], values["vllm:kv_cache_usage_perc"]


async def replay(url: str, workload: common.Workload) -> None:
    limits = httpx.Limits(max_connections=len(workload.prompts))
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:

        async def one(prompt: list[int], n: int) -> None:
            body = {"prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True}
            answer = await client.post("/v1/completions", json=body)
            answer.raise_for_status()
            assert answer.json()["usage"]["completion_tokens"] == n

        await asyncio.gather(
            *(one(p, n) for p, n in zip(workload.prompts, workload.output_lens, strict=True))
        )


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = demo_model()
    workload = common.make_workload(args.num_requests, common.vocab_size(model), args.seed)
    budget = args.kv_tokens * common.kv_bytes_per_token(model)
    extra = ("--no-enable-prefix-caching", "--max-model-len", str(args.max_model_len))
    extra += ("--block-size", "16", "--dtype", "float32")
    node = Node(Path(tempfile.mkdtemp(prefix="pagedllm-bench-waste-")), budget, extra)
    try:
        maps = MapReader(node.url)
        time.sleep(1.0)  # the page's watch reaches the scheduler
        samples: list[tuple[float, float]] = []
        done = threading.Event()
        started = time.monotonic()

        def sample() -> None:
            while not done.is_set():
                waste, usage = metric(node.http)
                if usage > 0:  # only while blocks are allocated, as memory.py samples
                    samples.append((waste, usage))
                time.sleep(SAMPLE_S)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        asyncio.run(replay(node.url, workload))
        done.set()
        sampler.join()
        maps.stop.set()
        wall = time.monotonic() - started
    finally:
        node.close()
    rows = [r for r in maps.rows if r["t"] >= started]
    return {
        "workload": workload.spec | {"seed": args.seed},
        "budget_tokens": args.kv_tokens,
        "wall_s": wall,
        "metric_samples": len(samples),
        "metric_waste_mean": statistics.fmean(w for w, _ in samples),
        "metric_waste_max": max(w for w, _ in samples),
        "maps": len(rows),
        "own_waste_mean": statistics.fmean(r["own"] for r in rows),
        "maps_agreeing": int(sum(r["agree"] for r in rows)),
        "series": {
            "metric": [w for w, _ in samples],
            "own": [r["own"] for r in rows],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--kv-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="memory_serve")
    args = parser.parse_args()
    common.warn_if_busy()
    print(f"trace (a): {args.num_requests} requests through pagedllm serve ...", flush=True)
    result = run(args)
    in_process = None
    reference = common.RESULTS / "memory.json"
    if reference.exists():
        in_process = json.loads(reference.read_text())["waste"]["runs"][0]["waste_mean"]
    common.print_table(
        ["count", "waste mean", "samples"],
        [
            ["/metrics " + WASTE, f"{result['metric_waste_mean']:.2%}", result["metric_samples"]],
            ["own count of the block maps", f"{result['own_waste_mean']:.2%}", result["maps"]],
            ["memory.py (a) in process, per step", f"{in_process:.2%}" if in_process else "-", ""],
        ],
        title=f"KV waste over trace (a), {result['wall_s']:.0f} s",
    )
    print(f"maps whose waste equals the own count: {result['maps_agreeing']} of {result['maps']}")
    targets = [
        common.Target(
            "KV waste (the node's metric, mean)",
            result["metric_waste_mean"],
            TARGET_WASTE,
            at_most=True,
        ),
        common.Target(
            "metric vs own count (difference of means)",
            abs(result["metric_waste_mean"] - result["own_waste_mean"]),
            TARGET_AGREEMENT,
            at_most=True,
        ),
        common.Target(
            "maps whose waste equals the own count",
            result["maps_agreeing"] / max(1, result["maps"]),
            1.0,
        ),
    ]
    common.print_targets(targets)
    data = {
        "benchmark": "memory_serve",
        "machine": common.machine_info(),
        "in_process_waste_mean": in_process,
        **result,
        "targets": [t.to_json() for t in targets],
    }
    print(f"\nwrote {common.write_json(args.name, data)}")
    fig, (ax,) = common.new_figure(width=7.0)
    ax.plot([100 * w for w in result["series"]["metric"]], label=f"/metrics {WASTE}")
    ax.set_xlabel(f"sample (every {SAMPLE_S * 1000:.0f} ms)")
    ax.set_ylabel("allocated KV slots holding no token (%)")
    ax.axhline(100 * TARGET_WASTE, color="grey", lw=0.8, ls="--", label="target")
    ax.set_title("KV waste of a running node, trace (a)")
    ax.legend(fontsize=8)
    common.save_figure(fig, args.name)


if __name__ == "__main__":
    main()
