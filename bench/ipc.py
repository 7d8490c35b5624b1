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

    python bench/ipc.py [--tokens 64] [--short 8] [--repeats 7] [--batches 1 32] [--stream]
        [--kv-events]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
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
from pagedllm.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.serve.worker_process import torch_threads

KV_CACHE_MEMORY = 64 << 20
TARGET_OVERHEAD = 0.10


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

    def __init__(self, log_dir: Path) -> None:
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
                    str(KV_CACHE_MEMORY),
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
    args = parser.parse_args()
    if not 1 <= args.short < args.tokens:
        parser.error("--short must be at least 1 and below --tokens")

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
