"""What the multi-process node costs over the in-process engine, per decode step.

Runs the same work both ways on the demo model: BATCH greedy requests (EOS ignored), once
through `LLMEngine.step()` in this process, once through a real `pagedllm serve` (API server,
scheduler and worker processes, ZeroMQ between them) with concurrent HTTP requests. Each way
the whole batch is timed twice, with TOKENS tokens per request and with SHORT; the difference
divided by TOKENS - SHORT is the time of one decode step, so that what happens once per
request (HTTP, tokenization, prefill, the last response) cancels out and what happens every
step (scheduling, plans and samples between processes) stays in. The requests are answered
once by default (their steps reach the API server merged with the end); ``--stream`` makes
them SSE streams, which the API server detokenizes and forwards every step. The best wall of
REPEATS at each length, the two ways interleaved. The last column is the scheduler's view of
the worker's time on a step (from the plan's arrival, or the end of the step before, to the
samples back). Target: the node adds at most 10 % at batch 32. ``--kv-events`` keeps a
subscriber on the node's ``GET /v1/kv_events`` throughout, as a router would.

``--kv-page`` measures instead what the block map costs the node: the same node's decode step
with a viewer of ``GET /kv`` (its feed ``/kv/events`` read throughout) against none, runs
interleaved, the median per-step time of each (after a viewer leaves, the run without waits
for the scheduler's watch on the page to lapse). Target: within the noise (2 %) at batch 32.

    python bench/ipc.py [--tokens 64] [--short 8] [--repeats 7] [--batches 1 32] [--stream]
        [--kv-events] [--kv-page]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from pagedllm.config import EngineConfig
from pagedllm.core.kv_map import take_map
from pagedllm.ipc import messages
from pagedllm.ipc.messages import KV_MAP_INTERVAL_S, WATCH_LEASE_S
from pagedllm.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.serve.worker_process import torch_threads

KV_CACHE_MEMORY = 64 << 20
TARGET_OVERHEAD = 0.10
TARGET_PAGE_COST = 0.02


def prompts(batch: int) -> list[str]:
    return [f"Benchmark request number {i} says" for i in range(batch)]


def in_process_wall_s(engine: LLMEngine, batch: int, tokens: int) -> float:
    """Seconds for the engine to run ``batch`` requests of ``tokens`` tokens to the end."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    for prompt in prompts(batch):
        engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - started


def per_step_s(walls: dict[int, list[float]], tokens: int, short: int) -> float:
    """Seconds per decode step from the best whole-batch walls at both lengths."""
    return (min(walls[tokens]) - min(walls[short])) / (tokens - short)


class Node:
    """A `pagedllm serve` child process on a free port."""

    def __init__(
        self, log_dir: Path, kv_cache_memory: int = KV_CACHE_MEMORY, extra: tuple[str, ...] = ()
    ) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / "serve.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pagedllm.cli",
                    "serve",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--kv-cache-memory",
                    str(kv_cache_memory),
                    *extra,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 300
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"pagedllm serve did not start:\n{self.log.read_text()}")
            time.sleep(0.2)
        self.http = httpx.Client(
            base_url=self.url, timeout=300, limits=httpx.Limits(max_connections=64)
        )

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wall_s(self, batch: int, tokens: int, stream: bool = False) -> float:
        """Seconds for ``batch`` concurrent requests of ``tokens`` tokens to be answered."""
        body = {"max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}

        def one(prompt: str) -> None:
            if stream:
                with self.http.stream(
                    "POST", "/v1/completions", json={**body, "prompt": prompt}
                ) as response:
                    response.raise_for_status()
                    events = [
                        line.removeprefix("data: ")
                        for line in response.iter_lines()
                        if line.startswith("data: {")
                    ]
                usage = json.loads(events[-1])["usage"]
            else:
                response = self.http.post("/v1/completions", json={**body, "prompt": prompt})
                response.raise_for_status()
                usage = response.json()["usage"]
            assert usage["completion_tokens"] == tokens

        with ThreadPoolExecutor(batch) as pool:
            started = time.perf_counter()
            list(pool.map(one, prompts(batch)))
            return time.perf_counter() - started

    def subscribe_kv_events(self) -> list[int]:
        """Read the node's KV-events feed in a thread; the returned list counts its lines."""
        lines = [0]

        def read() -> None:
            with httpx.stream("GET", f"{self.url}/v1/kv_events", timeout=30) as response:
                response.raise_for_status()
                for _ in response.iter_lines():
                    lines[0] += 1

        threading.Thread(target=read, daemon=True).start()
        return lines

    def view_kv_page(self) -> tuple[threading.Event, list[int]]:
        """Read the block map's feed in a thread until the returned event is set; the list
        counts the maps read."""
        stop, maps = threading.Event(), [0]

        def read() -> None:
            with httpx.stream("GET", f"{self.url}/kv/events", timeout=30) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    maps[0] += line.startswith("event: map")
                    if stop.is_set():
                        return

        threading.Thread(target=read, daemon=True).start()
        return stop, maps

    def scheduler_step_s(self) -> tuple[float, float]:
        """(sum, count) of the scheduler's plan-to-samples times so far."""
        values = {"sum": 0.0, "count": 0.0}
        name = "pagedllm:step_duration_seconds"
        for line in self.http.get("/metrics").text.splitlines():
            for part in values:
                if line.startswith(f"{name}_{part}"):
                    values[part] = float(line.rsplit(" ", 1)[1])
        return values["sum"], values["count"]

    def close(self) -> None:
        self.http.close()
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(60)
        shutil.rmtree(self.log.parent, ignore_errors=True)


def map_cost_s(batch: int, tokens: int) -> float:
    """Median seconds the scheduler spends on one block map (building it and encoding the
    message) with ``batch`` requests mid-decode, in this process."""
    engine = LLMEngine(EngineConfig(kv_cache_memory=KV_CACHE_MEMORY))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for prompt in prompts(batch):
        engine.add_request(prompt, params)
    for _ in range(tokens // 2):
        engine.step()
    s = engine.scheduler
    times = []
    for _ in range(200):
        started = time.perf_counter()
        stats = s.stats()
        messages.encode(take_map(s.block_manager, s.running, stats.num_running, stats.num_waiting))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def kv_page_cost(node: Node, batch: int, args: argparse.Namespace) -> dict[str, object]:
    """Per-step seconds with a block-map viewer and without, interleaved: each repeat runs
    both lengths both ways."""
    steps: dict[bool, list[float]] = {True: [], False: []}
    maps = 0
    node.wall_s(batch, 4, args.stream)  # warm-up
    for i in range(args.repeats):
        for viewed in (True, False) if i % 2 == 0 else (False, True):
            walls: dict[int, list[float]] = {}
            stop = None
            if viewed:
                stop, counted = node.view_kv_page()
                time.sleep(0.5)  # the watch reaches the scheduler
            for n in (args.tokens, args.short):
                walls[n] = [node.wall_s(batch, n, args.stream)]
            if stop is not None:
                stop.set()
                maps += counted[0]
                time.sleep(WATCH_LEASE_S + 0.5)  # the scheduler's watch lapses
            steps[viewed].append(per_step_s(walls, args.tokens, args.short))
    with_page, without = statistics.median(steps[True]), statistics.median(steps[False])
    cost = with_page / without - 1
    per_map = map_cost_s(batch, args.tokens)
    # The scheduler's share of a second spent on maps at their highest rate.
    share = per_map / KV_MAP_INTERVAL_S
    print(
        f"batch {batch}: one map costs the scheduler {per_map * 1e6:.0f} us (median of 200): "
        f"{share:.3%} of its time at the highest rate ({1 / KV_MAP_INTERVAL_S:.0f} a second)"
    )
    print(
        f"batch {batch}: decode step {without * 1e3:.2f} ms without a viewer of /kv, "
        f"{with_page * 1e3:.2f} ms with one ({cost:+.1%}; medians of {args.repeats} "
        f"interleaved runs; {maps} maps read)"
    )
    met = cost <= TARGET_PAGE_COST
    print(f"target: within {TARGET_PAGE_COST:.0%}: {'met' if met else 'NOT met'}")
    return {
        "batch": batch,
        "step_s_without": steps[False],
        "step_s_with_page": steps[True],
        "median_without_s": without,
        "median_with_page_s": with_page,
        "cost": cost,
        "maps_read": maps,
        "map_cost_s": per_map,
        "map_share_at_max_rate": share,
        "target": TARGET_PAGE_COST,
        "met": met,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--short", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument(
        "--stream",
        action="store_true",
        help="the node's requests are SSE streams (forwarded every step)",
    )
    parser.add_argument(
        "--kv-events",
        action="store_true",
        help="a subscriber reads the node's KV-events feed throughout",
    )
    parser.add_argument(
        "--kv-page",
        action="store_true",
        help="measure the node with a viewer of the block map (GET /kv) against none",
    )
    args = parser.parse_args()
    if not 1 <= args.short < args.tokens:
        parser.error("--short must be at least 1 and below --tokens")
    if args.kv_page:
        node = Node(Path(tempfile.mkdtemp(prefix="pagedllm-bench-ipc-")))
        try:
            runs = [kv_page_cost(node, batch, args) for batch in args.batches]
        finally:
            node.close()
        out = Path(__file__).parent / "results" / "ipc_kv_page.json"
        out.write_text(json.dumps({"benchmark": "ipc --kv-page", "runs": runs}, indent=1))
        return 0

    engine = LLMEngine(EngineConfig(kv_cache_memory=KV_CACHE_MEMORY))
    node = Node(Path(tempfile.mkdtemp(prefix="pagedllm-bench-ipc-")))
    feed_lines = node.subscribe_kv_events() if args.kv_events else None
    threads = torch.get_num_threads()
    print(
        f"demo model, {args.tokens} - {args.short} tokens per request "
        f"({'streamed' if args.stream else 'answered once'}), best of "
        f"{args.repeats}, {os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.1f}); "
        f"torch threads: in-process {threads}, node worker {torch_threads(1)}"
    )
    print(
        f"{'batch':>5}  {'in-process':>10}  {'node':>10}  {'overhead':>8}  {'scheduler view':>14}"
    )
    results = {}
    try:
        for batch in args.batches:
            in_process_wall_s(engine, batch, 4)  # warm-up
            node.wall_s(batch, 4, args.stream)
            local: dict[int, list[float]] = {args.tokens: [], args.short: []}
            remote: dict[int, list[float]] = {args.tokens: [], args.short: []}
            sched = []
            for _ in range(args.repeats):  # interleaved, so that both see the same machine
                for n in (args.tokens, args.short):
                    local[n].append(in_process_wall_s(engine, batch, n))
                    before = node.scheduler_step_s()
                    remote[n].append(node.wall_s(batch, n, args.stream))
                    after = node.scheduler_step_s()
                    if n == args.tokens:
                        sched.append((after[0] - before[0]) / max(1.0, after[1] - before[1]))
            local_s = per_step_s(local, args.tokens, args.short)
            remote_s = per_step_s(remote, args.tokens, args.short)
            overhead = remote_s / local_s - 1
            results[batch] = overhead
            print(
                f"{batch:>5}  {local_s * 1e3:>8.2f}ms  {remote_s * 1e3:>8.2f}ms  "
                f"{overhead:>+8.1%}  {min(sched) * 1e3:>12.2f}ms"
            )
    finally:
        node.close()
    if feed_lines is not None:
        print(f"KV-events feed: {feed_lines[0]} lines read")
    if 32 in results:
        met = results[32] <= TARGET_OVERHEAD
        print(
            f"target: the node adds <= {TARGET_OVERHEAD:.0%} at batch 32: "
            f"{results[32]:+.1%} -> {'met' if met else 'NOT met'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
