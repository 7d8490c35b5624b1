"""A node under steady, rough traffic: does any process grow, and does the front keep answering?

Starts a real `pagedllm serve` (demo model, 64 MiB KV cache) and runs ROUNDS rounds of 200
concurrent streams, half of whose clients hang up after two chunks (their requests ask for
1,000 tokens and must be aborted). After each round it reads every process's resident memory
(VmRSS from /proc) and checks that the node is idle again (nothing running, no KV block held).
Then, with the node warm, it sends four 2 MB prompts to ``POST /tokenize`` and four to
``/v1/completions`` while timing ``GET /health`` and a small completion every 20 ms.

Targets: every process within 5 % of its size after round WARMUP (default 5) at every later
round; ``/health`` and the small requests answer within 100 ms while the large prompts are
tokenized.

    python bench/soak.py [--rounds 40] [--warmup 5] [--streams 200] [--no-large-prompts]
                         [--name soak]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from common import (
    Target,
    free_port,
    machine_info,
    new_figure,
    print_table,
    print_targets,
    save_figure,
    write_json,
)

MODEL = "pagedllm-demo"
GROWTH_LIMIT = 0.05
LATENCY_TARGET_S = 0.100
LARGE_PROMPT_BYTES = 2 << 20


def start_node(workdir: Path, port: int) -> tuple[subprocess.Popen, Path]:
    log_path = workdir / "node.log"
    env = {**os.environ, "TMPDIR": str(workdir)}
    argv = [sys.executable, "-m", "pagedllm.cli", "serve", "--host", "127.0.0.1"]
    # Info level: the node's log lines name each process with its pid.
    argv += ["--port", str(port), "--kv-cache-memory", "64MiB", "--log-level", "info"]
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"the node exited with {process.returncode}:\n{log_path.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, log_path
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    sys.exit("the node did not become ready within 300 s")


def node_processes(log_path: Path) -> dict[str, int]:
    """Each process's role -> pid, as the node's log lines name them."""
    return {
        m[0]: int(m[1]) for m in re.findall(r"\[([a-z ]+\d?) pid (\d+)\]", log_path.read_text())
    }


def resident_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024


def metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    )


async def one_stream(client: httpx.AsyncClient, index: int, keep: bool) -> bool:
    """True when the stream went as asked: read to [DONE], or left after two chunks."""
    body = {
        "model": MODEL,
        "prompt": f"Soak stream number {index}",
        "stream": True,
        "ignore_eos": True,
        "max_tokens": 24 if keep else 1000,
    }
    chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return False
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                return keep
            if line.startswith("data: "):
                if "error" in json.loads(line[6:]):
                    return False
                chunks += 1
                if not keep and chunks == 2:
                    return True
    return False


def run_round(url: str, streams: int) -> int:
    """One round; the number of streams that did not go as asked."""

    async def run() -> list[bool]:
        limits = httpx.Limits(max_connections=streams + 50, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=300) as client:
            return await asyncio.gather(
                *(one_stream(client, i, i % 2 == 0) for i in range(streams))
            )

    results = asyncio.run(run())
    deadline = time.monotonic() + 60
    while metric(url, "vllm:num_requests_running") or metric(url, "vllm:kv_cache_usage_perc"):
        if time.monotonic() > deadline:
            sys.exit("the node did not go idle within 60 s of a round")
        time.sleep(0.2)
    return results.count(False)


def probe_latencies(url: str, stop: threading.Event) -> dict[str, list[float]]:
    """``GET /health`` and a one-token completion, one after the other, until ``stop``."""
    seen: dict[str, list[float]] = {"health": [], "small completion": []}
    small = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    with httpx.Client(base_url=url, timeout=60) as client:
        while not stop.is_set():
            for name, call in (
                ("health", lambda: client.get("/health")),
                ("small completion", lambda: client.post("/v1/completions", json=small)),
            ):
                started = time.perf_counter()
                call().raise_for_status()
                seen[name].append(time.perf_counter() - started)
            time.sleep(0.02)
    return seen


def large_prompts(url: str) -> dict[str, list[float]]:
    """Four 2 MB prompts to /tokenize and four to /v1/completions at once (the completions are
    refused as too long: what matters is that tokenizing them does not stall the front)."""
    text = ("lorem ipsum dolor sit amet " * (LARGE_PROMPT_BYTES // 27 + 1))[:LARGE_PROMPT_BYTES]

    def send(path: str, body: dict) -> None:
        httpx.post(f"{url}{path}", json=body, timeout=300)

    stop = threading.Event()
    seen: dict[str, list[float]] = {}
    prober = threading.Thread(target=lambda: seen.update(probe_latencies(url, stop)))
    prober.start()
    time.sleep(0.5)
    senders = [
        threading.Thread(target=send, args=("/tokenize", {"model": MODEL, "prompt": text}))
        for _ in range(4)
    ] + [
        threading.Thread(
            target=send, args=("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 1})
        )
        for _ in range(4)
    ]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    stop.set()
    prober.join()
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--no-large-prompts", action="store_true")
    parser.add_argument("--name", default="soak", help="file name of the results")
    args = parser.parse_args()
    if not 0 < args.warmup < args.rounds:
        parser.error("need 0 < --warmup < --rounds")

    workdir = Path(tempfile.mkdtemp(prefix="pagedllm-soak-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process, log_path = start_node(workdir, port)
    try:
        roles = node_processes(log_path)
        if not roles:
            sys.exit(f"found no process of the node in its log:\n{log_path.read_text()}")
        history: dict[str, list[float]] = {role: [] for role in roles}
        failures = []
        for number in range(1, args.rounds + 1):
            started = time.perf_counter()
            failures.append(run_round(url, args.streams))
            for role, pid in roles.items():
                history[role].append(resident_mb(pid))
            sizes = "  ".join(f"{role} {mb[-1]:.0f}" for role, mb in history.items())
            print(
                f"round {number:3d}  {time.perf_counter() - started:5.1f} s  "
                f"failed {failures[-1]}  RSS MB: {sizes}",
                flush=True,
            )
        latencies = {} if args.no_large_prompts else large_prompts(url)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()

    base = args.warmup - 1
    growth = {role: max(mb[base:]) / mb[base] - 1 for role, mb in history.items()}
    rows = [
        [role, mb[0], mb[base], mb[-1], max(mb[base:]), f"{100 * growth[role]:+.1f} %"]
        for role, mb in history.items()
    ]
    print_table(
        ["process", "round 1 MB", f"round {args.warmup} MB", "last MB", "max after", "growth"],
        rows,
        title=f"Resident memory over {args.rounds} rounds of {args.streams} streams",
    )
    targets = [
        Target(
            f"{role}: largest size after round {args.warmup} vs at it",
            100 * growth[role],
            100 * GROWTH_LIMIT,
            at_most=True,
            unit=" %",
        )
        for role in history
    ]
    targets.append(Target("streams that did not go as asked", sum(failures), 0, at_most=True))
    for name, values in latencies.items():
        print(
            f"{name} while tokenizing large prompts: {len(values)} calls, max {max(values):.3f} s"
        )
        targets.append(
            Target(
                f"{name} latency while large prompts are tokenized (max)",
                1000 * max(values),
                1000 * LATENCY_TARGET_S,
                at_most=True,
                unit=" ms",
            )
        )
    print_targets(targets)

    fig, (axis,) = new_figure(width=7)
    for role, mb in history.items():
        axis.plot(range(1, len(mb) + 1), mb, label=role, marker=".")
    axis.axvline(args.warmup, color="grey", linestyle=":")
    axis.set_xlabel("round")
    axis.set_ylabel("resident memory (MB)")
    axis.set_title(f"pagedllm serve, {args.streams} streams a round, half hanging up")
    axis.legend()
    figure = save_figure(fig, args.name)
    result = write_json(
        args.name,
        {
            "machine": machine_info(),
            "rounds": args.rounds,
            "streams": args.streams,
            "warmup": args.warmup,
            "resident_mb": history,
            "failures": failures,
            "latencies_s": latencies,
            "targets": [t.to_json() for t in targets],
        },
    )
    print(f"\nwrote {result} and {figure}")


if __name__ == "__main__":
    main()
