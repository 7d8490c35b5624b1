"""What the multi-process node costs over the in-process engine, per decode step.

Runs the same work both ways on the demo model: BATCH greedy requests of TOKENS tokens each
(EOS ignored), once through `LLMEngine.step()` in this process, once through a real
`pagedllm serve` (API server, scheduler and worker processes, ZeroMQ between them) with
concurrent HTTP requests. A decode step is timed in-process as the mean `step()` after the
prefill, and in the node as the mean gap between a request's successive outputs reaching the
API server (vllm:inter_token_latency_seconds), so that both count detokenization and neither
counts how the HTTP requests trickle in. Best of REPEATS. The in-process engine runs with
torch's default threads and with the node worker's (which leaves a core to the API server and
the scheduler). The overhead that counts is against the faster of the two; the one against the
same thread count shows what the processes and their messages cost by themselves. The last
column is the scheduler's own view of a node step (plan sent to samples back), which leaves
out the HTTP front. Target: the node adds at most 10 % at batch 32.

    python bench/ipc.py [--tokens 64] [--repeats 7] [--batches 1 32]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _bootstrap

_bootstrap.use_checkout()

import httpx  # noqa: E402
import torch  # noqa: E402

from pagedllm.node.config import EngineConfig  # noqa: E402
from pagedllm.node.engine import LLMEngine  # noqa: E402
from pagedllm.node.sampling_params import SamplingParams  # noqa: E402
from pagedllm.node.worker_process import torch_threads  # noqa: E402

KV_CACHE_MEMORY = 64 << 20
TARGET_OVERHEAD = 0.10
BOOTSTRAP = str(Path(__file__).resolve().with_name("_bootstrap.py"))


def prompts(batch: int) -> list[str]:
    return [f"Benchmark request number {i} says" for i in range(batch)]


def in_process_step_s(engine: LLMEngine, batch: int, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for prompt in prompts(batch):
        engine.add_request(prompt, params)
    engine.step()  # the prefill
    steps = 0
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return (time.perf_counter() - started) / steps


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
                [sys.executable, BOOTSTRAP, "pagedllm.node.cli", "serve", "--host", "127.0.0.1",
                 "--port", str(self.port), "--kv-cache-memory", str(KV_CACHE_MEMORY)],
                stdout=log, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 300
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"pagedllm serve did not start:\n{self.log.read_text()}")
            time.sleep(0.2)
        self.http = httpx.Client(base_url=self.url, timeout=300,
                                 limits=httpx.Limits(max_connections=64))

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def run(self, batch: int, tokens: int) -> None:
        def one(prompt: str) -> None:
            response = self.http.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True,
            })
            response.raise_for_status()
            assert response.json()["usage"]["completion_tokens"] == tokens

        with ThreadPoolExecutor(batch) as pool:
            list(pool.map(one, prompts(batch)))

    def histogram(self, name: str) -> tuple[float, float]:
        """(sum, count) of histogram ``name`` so far."""
        values = {"sum": 0.0, "count": 0.0}
        for line in self.http.get("/metrics").text.splitlines():
            for part in values:
                if line.startswith(f"{name}_{part}"):
                    values[part] = float(line.rsplit(" ", 1)[1])
        return values["sum"], values["count"]

    def step_s(self, batch: int, tokens: int) -> tuple[float, float]:
        """Mean seconds per decode step: as the API server sees outputs arrive, and as the
        scheduler sees the workers answer."""
        names = ("vllm:inter_token_latency_seconds", "pagedllm:step_duration_seconds")
        before = [self.histogram(name) for name in names]
        self.run(batch, tokens)
        after = [self.histogram(name) for name in names]
        itl, step = (
            (a[0] - b[0]) / max(1.0, a[1] - b[1]) for a, b in zip(after, before, strict=True)
        )
        return itl, step

    def close(self) -> None:
        self.http.close()
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(60)
        shutil.rmtree(self.log.parent, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    args = parser.parse_args()

    engine = LLMEngine(EngineConfig(kv_cache_memory=KV_CACHE_MEMORY))
    node = Node(Path(tempfile.mkdtemp(prefix="pagedllm-bench-ipc-")))
    default_threads, worker_threads = torch.get_num_threads(), torch_threads(1)
    print(f"demo model, {args.tokens} tokens per request, best of {args.repeats}, "
          f"{os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.1f}); torch threads: "
          f"in-process {default_threads} or {worker_threads}, node worker {worker_threads}")
    print(f"{'batch':>5}  {f'in-proc/{default_threads}t':>12}  {f'in-proc/{worker_threads}t':>12}"
          f"  {'node':>10}  {'overhead':>8}  {'same threads':>12}  {'scheduler view':>14}")
    results = {}
    try:
        for batch in args.batches:
            in_process_step_s(engine, batch, 4)  # warm-up
            node.run(batch, 4)
            local: dict[int, list[float]] = {default_threads: [], worker_threads: []}
            remote, sched = [], []
            for _ in range(args.repeats):  # interleaved, so that both see the same machine
                for threads in local:
                    torch.set_num_threads(threads)
                    local[threads].append(in_process_step_s(engine, batch, args.tokens))
                itl, step = node.step_s(batch, args.tokens)
                remote.append(itl)
                sched.append(step)
            best = {threads: min(times) for threads, times in local.items()}
            overhead = min(remote) / min(best.values()) - 1
            same_threads = min(remote) / best[worker_threads] - 1
            results[batch] = overhead
            print(f"{batch:>5}  {best[default_threads] * 1e3:>10.2f}ms  "
                  f"{best[worker_threads] * 1e3:>10.2f}ms  {min(remote) * 1e3:>8.2f}ms  "
                  f"{overhead:>+8.1%}  {same_threads:>+12.1%}  {min(sched) * 1e3:>12.2f}ms")
    finally:
        node.close()
    if 32 in results:
        met = results[32] <= TARGET_OVERHEAD
        print(f"target: the node adds <= {TARGET_OVERHEAD:.0%} at batch 32: "
              f"{results[32]:+.1%} -> {'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
