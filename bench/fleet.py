"""Fleet: three nodes behind `pagedllm router`, prefix-aware routing against random spreading
(what a Kubernetes Service does) and round robin, and the router's own cost.

(a) Shared prefixes. Three nodes of the benchmark model, each pinned to its share of the cores
    and with a KV cache that holds about 3 of the 8 system prompts (1,024 tokens each) besides
    the blocks of its share of the requests in flight (their questions and outputs); requests
    are a system prompt and a 64-token question, in random order, 32 output tokens each, sent
    by a closed loop of 12 clients through the router. The router runs each policy in turn
    (``random`` is the router's own ``--policy random``, used only for comparisons: a uniform
    choice per request, as a Service's kube-proxy makes). Each policy gets its own 8 system
    prompts, so no run finds another's blocks. The reference is one node alone serving the same
    requests with the whole fleet's KV cache: the hit rate a perfectly shared cache reaches.
    Hit rates come from the nodes' ``vllm:prefix_cache_hits`` / ``queries`` counters.
(b) Balance: the same fleet and policy ``prefix`` on a uniform workload (no shared prefix):
    the busiest node's share of the requests against the mean.
(c) The router's cost: one node called directly and through the router, at concurrency 1 and
    32 (short prompts, 32 tokens out), three interleaved runs, medians: lost throughput, time
    to first token, and what the node did meanwhile (steps, their mean duration, the share of
    the time it was stepping). With the model in the path a first token takes 0.2 s at 1 and
    6 s at 32, varying by tens of milliseconds between requests and by a tenth between runs:
    far too much to see 2 ms in, so the added time's target is (d)'s.
(d) The router's added time to first token alone: a stand-in node that answers at once
    (``instant_node.py``) called directly and through the router, at concurrency 1 (request by
    request in turn, short prompts and the prompt length of (a)) and 32 (closed loops, runs
    alternating; the stand-in sends a token every 30 ms after the first, as a node does, and
    the clients start staggered over a request's duration, as independent users arrive, not
    in bursts of 32 that queue behind each other wherever they go). The router has a core of
    its own, as router pods have in a cluster; the stand-in and this load generator share the
    other (``--instant-client router`` puts the load generator on the router's core instead,
    where its own work after sending a request, which overlaps with a node on another core,
    holds up the router).

    python bench/fleet.py [--requests 240] [--warmup 24] [--parts a,b,c,d]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import common

TARGET_HIT_RATE_SHARE = 0.90
TARGET_TTFT_GAIN = 2.0
TARGET_BUSIEST_SHARE = 1.3
TARGET_ADDED_TTFT_MS = 2.0
TARGET_THROUGHPUT_LOSS = 0.05
PAGEDLLM = str(Path(sys.executable).with_name("pagedllm"))
INSTANT_NODE = Path(__file__).resolve().parent / "instant_node.py"
BLOCK_SIZE = 16  # the nodes' default
START_TIMEOUT_S = 600


# ----- processes -----------------------------------------------------------------------------


@dataclass
class Process:
    name: str
    port: int
    popen: subprocess.Popen
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics(self) -> dict[str, float]:
        """Sums of /metrics samples by name (labels summed over)."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as response:
            text = response.read().decode()
        sums: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
        return sums

    def cpu_seconds(self) -> float:
        """CPU time the process has used so far (user and system)."""
        fields = Path(f"/proc/{self.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        common.stop_process(self.popen, timeout=60)


def launch(
    name: str,
    argv: list[str],
    workdir: Path,
    cores: set[int] | None,
    threads: int,
    program: tuple[str, ...] = (PAGEDLLM,),
) -> Process:
    """``program argv`` on a free port (it takes ``--host``, ``--port`` and ``--log-level``),
    pinned to ``cores``."""
    port = common.free_port()
    log = workdir / f"{name}.log"
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))

    def pin() -> None:
        if cores:
            os.sched_setaffinity(0, cores)

    with log.open("w") as out:
        popen = subprocess.Popen(
            [*program, *argv, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
            env=env,
            cwd=workdir,  # outside the repository: its operator/ would shadow the stdlib's
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=pin,
        )
    return Process(name, port, popen, log)


def wait_healthy(process: Process) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.popen.poll() is not None:
            raise RuntimeError(f"{process.name} exited; see {process.log}")
        try:
            with urllib.request.urlopen(f"{process.url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{process.name} not ready after {START_TIMEOUT_S} s")
        time.sleep(0.5)


def start_nodes(
    args: argparse.Namespace,
    model: Path,
    count: int,
    kv_tokens: int,
    workdir: Path,
    tag: str,
    cores: list[int] | None = None,
    extra: Sequence[str] = (),
) -> list[Process]:
    """``count`` nodes sharing ``cores`` (default: all this process may use), each started
    with ``extra`` arguments besides the fleet's."""
    cores = cores or sorted(os.sched_getaffinity(0))
    threads = max(1, len(cores) // count)
    kv_bytes = kv_tokens * common.kv_bytes_per_token(model)
    nodes = []
    for i in range(count):
        # Node i gets its own slice of the cores (wrapping round when there are fewer cores).
        share = {cores[(i * threads + k) % len(cores)] for k in range(threads)}
        argv = [
            "serve",
            "--model",
            str(model),
            "--served-model-name",
            "bench",
            "--kv-cache-memory",
            str(kv_bytes),
            "--max-model-len",
            str(args.system_len + args.question_len + args.output_len + 64),
            *extra,
        ]
        nodes.append(launch(f"{tag}-node{i}", argv, workdir, share, threads))
    for node in nodes:
        wait_healthy(node)
    return nodes


def start_router(
    model: Path,
    nodes: list[Process],
    policy: str,
    workdir: Path,
    load_bound: float | None = None,
    cores: set[int] | None = None,
) -> Process:
    argv = [
        "router",
        "--model",
        str(model),
        "--served-model-name",
        "bench",
        "--backends",
        ",".join(n.url for n in nodes),
        "--policy",
        policy,
        *(["--load-bound", str(load_bound)] if load_bound is not None else []),
    ]
    router = launch(f"router-{policy}", argv, workdir, cores, 1)
    wait_healthy(router)
    deadline = time.monotonic() + 120
    while router.metrics().get("pagedllm:router_backend_ready", 0) < len(nodes):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the router never saw every node's feed; see {router.log}")
        time.sleep(0.2)
    return router


# ----- workload and load generator -----------------------------------------------------------


def word_tokens(tokenizer: Any) -> list[str]:
    """Tokens that are one word with its leading space and encode back to themselves: text
    made of them has exactly as many tokens as words (the tokenizer never merges across a
    space), so prompts have the lengths asked for."""
    words = []
    for token in range(common.FIRST_PLAIN_TOKEN, tokenizer.vocab_size):
        text = tokenizer.decode([token])
        if (
            len(text) > 1
            and text[0] == " "
            and text[1:].isalpha()
            and tokenizer.encode(text, add_special_tokens=False) == [token]
        ):
            words.append(text)
    return words


def random_texts(tokenizer: Any, count: int, length: int, rng: random.Random) -> list[str]:
    words = word_tokens(tokenizer)
    return ["".join(rng.choices(words, k=length)) for _ in range(count)]


def shared_prefix_requests(
    tokenizer: Any, args: argparse.Namespace, seed: int, total: int
) -> list[tuple[int, str]]:
    """(system prompt index, prompt text): a random system prompt and question each."""
    rng = random.Random(seed)
    systems = random_texts(tokenizer, args.prompts, args.system_len, rng)
    questions = random_texts(tokenizer, total, args.question_len, rng)
    picks = [rng.randrange(args.prompts) for _ in range(total)]
    return [(p, systems[p] + questions[i]) for i, p in enumerate(picks)]


@dataclass
class LoadResult:
    ttft_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    errors: int = 0
    elapsed_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        ms = [1e3 * t for t in self.ttft_s]
        return {
            "requests": len(self.ttft_s),
            "errors": self.errors,
            "elapsed_s": self.elapsed_s,
            "output_tokens_per_s": self.output_tokens / self.elapsed_s if self.elapsed_s else 0,
            "ttft_p50_ms": common.percentile(ms, 50),
            "ttft_p99_ms": common.percentile(ms, 99),
        }


async def one_request(
    client: Any, prompt: str, output_len: int, result: LoadResult, model: str = "bench"
) -> None:
    """One streamed completion, its time to first token and tokens counted in ``result``.

    Tokens are the usage the stream ends with, not its events: a node that falls behind its
    clients sends several tokens in one event, so events undercount by a share that depends
    on the load (by 5 to 10 % at concurrency 32)."""
    start = time.perf_counter()
    first = None
    try:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=output_len,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and first is None:  # a token (its text may still be empty)
                first = time.perf_counter() - start
            if chunk.usage is not None:
                result.output_tokens += chunk.usage.completion_tokens
        if first is not None:
            result.ttft_s.append(first)
    except Exception as error:  # noqa: BLE001 - every failure counts, and is shown
        result.errors += 1
        print(f"  request failed: {error}", flush=True)


def openai_client(url: str) -> Any:
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=1800, max_retries=0)


async def closed_loop(
    url: str, prompts: list[str], concurrency: int, output_len: int, stagger_s: float = 0.0
) -> LoadResult:
    """``concurrency`` clients, each sending the next prompt as soon as its last one ended;
    client ``i`` starts ``i * stagger_s`` after the first."""
    client = openai_client(url)
    result = LoadResult()
    queue = list(reversed(prompts))

    async def one_client(i: int) -> None:
        await asyncio.sleep(i * stagger_s)
        while queue:
            await one_request(client, queue.pop(), output_len, result)

    begin = time.perf_counter()
    await asyncio.gather(*(one_client(i) for i in range(concurrency)))
    result.elapsed_s = time.perf_counter() - begin
    await client.close()
    return result


async def taking_turns(
    urls: dict[str, str], prompts: list[str], output_len: int
) -> dict[str, LoadResult]:
    """One request at a time, the targets taking turns: what drifts on the machine during
    the run weighs on each the same."""
    clients = {name: openai_client(url) for name, url in urls.items()}
    results = {name: LoadResult() for name in urls}
    names = list(urls)
    for i, prompt in enumerate(prompts):
        name = names[i % len(names)]
        begin = time.perf_counter()
        await one_request(clients[name], prompt, output_len, results[name])
        results[name].elapsed_s += time.perf_counter() - begin
    for client in clients.values():
        await client.close()
    return results


def routed_by_reason(router: Process) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{router.url}/metrics", timeout=30) as response:
        text = response.read().decode()
    return {
        sample.labels["reason"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "pagedllm:router_requests_routed_total"
    }


def counters(nodes: list[Process]) -> list[dict[str, float]]:
    return [n.metrics() for n in nodes]


def deltas(before: list[dict[str, float]], after: list[dict[str, float]], name: str) -> list[float]:
    return [a.get(name, 0.0) - b.get(name, 0.0) for b, a in zip(before, after, strict=True)]


def run_workload(
    url: str, nodes: list[Process], warmup: list[str], measured: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    asyncio.run(closed_loop(url, warmup, args.concurrency, args.output_len))
    before = counters(nodes)
    load = asyncio.run(closed_loop(url, measured, args.concurrency, args.output_len))
    after = counters(nodes)
    hits = deltas(before, after, "vllm:prefix_cache_hits_total")
    queries = deltas(before, after, "vllm:prefix_cache_queries_total")
    served = deltas(before, after, "vllm:request_success_total")
    return load.summary() | {
        "prefix_hit_rate": sum(hits) / sum(queries) if sum(queries) else None,
        "requests_per_node": served,
        "hits_per_node": hits,
        "queries_per_node": queries,
        "busiest_share": max(served) / statistics.mean(served) if sum(served) else None,
    }


# ----- the parts -----------------------------------------------------------------------------


def node_kv_tokens(args: argparse.Namespace) -> int:
    """A fleet node's KV cache: ``--cache-prompts`` system prompts, besides the blocks of its
    share of the requests in flight (their questions and outputs, a partial block each)."""
    in_flight = -(-args.concurrency // args.nodes)
    working = in_flight * (args.question_len + args.output_len + BLOCK_SIZE)
    return round(args.cache_prompts * args.system_len) + working


def part_a(args, model, tokenizer, workdir) -> dict[str, Any]:
    kv_tokens = node_kv_tokens(args)
    total = args.warmup + args.requests
    runs: dict[str, Any] = {}
    nodes = start_nodes(args, model, args.nodes, kv_tokens, workdir, "fleet")
    try:
        for index, policy in enumerate(args.policies):
            requests = [p for _, p in shared_prefix_requests(tokenizer, args, 100 + index, total)]
            router = start_router(model, nodes, policy, workdir, args.load_bound)
            try:
                print(
                    f"(a) policy {policy}: {args.warmup} + {args.requests} requests ...", flush=True
                )
                runs[policy] = run_workload(
                    router.url, nodes, requests[: args.warmup], requests[args.warmup :], args
                )
                runs[policy]["routed_by_reason"] = routed_by_reason(router)
            finally:
                router.stop()
            print(f"    {runs[policy]}", flush=True)
    finally:
        for node in nodes:
            node.stop()
    if args.one_node:
        requests = [p for _, p in shared_prefix_requests(tokenizer, args, 99, total)]
        (alone,) = start_nodes(args, model, 1, kv_tokens * args.nodes, workdir, "alone")
        try:
            print(f"(a) one node with the fleet's cache: {total} requests ...", flush=True)
            runs["one node"] = run_workload(
                alone.url, [alone], requests[: args.warmup], requests[args.warmup :], args
            )
        finally:
            alone.stop()
    return {"kv_tokens_per_node": kv_tokens, "runs": runs}


def part_b(args, model, tokenizer, workdir) -> dict[str, Any]:
    kv_tokens = node_kv_tokens(args)
    rng = random.Random(7)
    prompts = random_texts(tokenizer, args.uniform_requests, args.uniform_len, rng)
    nodes = start_nodes(args, model, args.nodes, kv_tokens, workdir, "uniform")
    try:
        router = start_router(model, nodes, "prefix", workdir, args.load_bound)
        try:
            print(f"(b) uniform workload, {len(prompts)} requests ...", flush=True)
            return run_workload(router.url, nodes, [], prompts, args)
        finally:
            router.stop()
    finally:
        for node in nodes:
            node.stop()


def split_cores() -> tuple[set[int] | None, set[int] | None]:
    """(the node's cores, the router's): as in a cluster, where router pods have cores of
    their own, the node on all cores but the first, the router and this load generator on
    the first. The node then runs on the same cores whether called directly or routed."""
    cores = sorted(os.sched_getaffinity(0))
    return (set(cores[1:]), {cores[0]}) if len(cores) > 1 else (None, None)


@contextlib.contextmanager
def behind_router(
    model: Path,
    workdir: Path,
    start_node: Callable[[], Process],
    router_cores: set[int] | None,
    client_cores: set[int] | None = None,
) -> Iterator[tuple[Process, Process]]:
    """A node (``start_node()``) and a router in front of it, this process on
    ``client_cores`` (default: the router's) meanwhile; both stopped, and this process on all
    its cores again, after."""
    cores = os.sched_getaffinity(0)
    client_cores = client_cores or router_cores
    if client_cores:
        os.sched_setaffinity(0, client_cores)
    try:
        node = start_node()
        try:
            router = start_router(model, [node], "prefix", workdir, cores=router_cores)
            try:
                yield node, router
            finally:
                router.stop()
        finally:
            node.stop()
    finally:
        os.sched_setaffinity(0, cores)


def node_steps(before: dict[str, float], after: dict[str, float], elapsed: float) -> dict:
    """What the node did between two readings of its /metrics: its steps, their mean
    duration, the share of ``elapsed`` it spent in them, and the tokens it generated."""
    count = (
        after["pagedllm:step_duration_seconds_count"]
        - before["pagedllm:step_duration_seconds_count"]
    )
    seconds = (
        after["pagedllm:step_duration_seconds_sum"] - before["pagedllm:step_duration_seconds_sum"]
    )
    tokens = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    return {
        "node_steps": count,
        "node_step_ms": 1e3 * seconds / count if count else None,
        "node_busy": seconds / elapsed if elapsed else None,
        "node_generation_tokens": tokens,
    }


def part_c(args, model, tokenizer, workdir) -> dict[str, Any]:
    per_prompt = args.overhead_len + args.output_len
    node_cores, router_cores = split_cores() if args.overhead_cores == "split" else (None, None)
    rows: dict[str, list[dict[str, Any]]] = {}

    def start_node() -> Process:
        cores = sorted(node_cores or ())
        return start_nodes(args, model, 1, 64 * per_prompt, workdir, "overhead", cores)[0]

    with behind_router(model, workdir, start_node, router_cores) as (node, router):
        targets = {"direct": node.url, "router": router.url}
        rng = random.Random(11)
        for run in range(args.overhead_runs):
            for concurrency in args.overhead_concurrency:
                count = max(args.overhead_min_requests, 4 * concurrency)
                for url in targets.values():  # warm the connections and the path first
                    warm = random_texts(tokenizer, concurrency, args.overhead_len, rng)
                    asyncio.run(closed_loop(url, warm, concurrency, 4))
                cpu_before = router.cpu_seconds()
                if concurrency == 1:
                    # Request by request in turn: a drift of the machine's speed within
                    # the run weighs on both alike.
                    prompts = random_texts(tokenizer, 2 * count, args.overhead_len, rng)
                    results = asyncio.run(taking_turns(targets, prompts, args.output_len))
                    steps: dict[str, dict[str, Any]] = {}  # the targets' steps interleave
                else:
                    # Run by run, each run starting with the other target than the last.
                    order = list(targets) if run % 2 == 0 else list(reversed(targets))
                    results, steps = {}, {}
                    for target in order:
                        prompts = random_texts(tokenizer, count, args.overhead_len, rng)
                        before = node.metrics()
                        results[target] = asyncio.run(
                            closed_loop(targets[target], prompts, concurrency, args.output_len)
                        )
                        steps[target] = node_steps(
                            before, node.metrics(), results[target].elapsed_s
                        )
                for target, load in results.items():
                    row = load.summary() | {"run": run, "concurrency": concurrency}
                    row |= steps.get(target, {})
                    direct = results["direct"].ttft_s
                    if target == "router" and concurrency == 1 and len(direct) == len(load.ttft_s):
                        # Each routed request against the direct one just before it.
                        row["paired_added_ms"] = [
                            1e3 * (r - d) for d, r in zip(direct, load.ttft_s, strict=True)
                        ]
                    if target == "router":
                        # Over the block, the direct requests' time included.
                        used = router.cpu_seconds() - cpu_before
                        row["router_cpu_ms_per_request"] = 1e3 * used / len(load.ttft_s)
                    rows.setdefault(f"{target}@{concurrency}", []).append(row)
                    print(f"(c) run {run} {target} c={concurrency}: {row}", flush=True)
    summary = {}
    for concurrency in args.overhead_concurrency:
        direct, routed = rows[f"direct@{concurrency}"], rows[f"router@{concurrency}"]
        med = statistics.median
        d_ttft, r_ttft = (
            med(r["ttft_p50_ms"] for r in direct),
            med(r["ttft_p50_ms"] for r in routed),
        )
        d_tput = med(r["output_tokens_per_s"] for r in direct)
        r_tput = med(r["output_tokens_per_s"] for r in routed)
        summary[concurrency] = {
            "direct_ttft_p50_ms": d_ttft,
            "router_ttft_p50_ms": r_ttft,
            "added_ttft_p50_ms": r_ttft - d_ttft,
            "direct_tokens_per_s": d_tput,
            "router_tokens_per_s": r_tput,
            "throughput_loss": 1 - r_tput / d_tput,
            "router_cpu_ms_per_request": med(r["router_cpu_ms_per_request"] for r in routed),
        }
        paired = [d for r in routed for d in r.get("paired_added_ms", [])]
        if paired:
            summary[concurrency]["paired_added_ttft_ms"] = med(paired)
    return {"runs": rows, "summary": summary}


def part_d(args, model, tokenizer, workdir) -> dict[str, Any]:
    node_cores, router_cores = split_cores()
    client_cores = node_cores if args.instant_client == "node" else router_cores
    rows: dict[str, list[dict[str, Any]]] = {}
    rng = random.Random(13)
    long_len = args.system_len + args.question_len
    for concurrency in args.overhead_concurrency:
        # Above concurrency 1 tokens come at a node's pace: a closed loop against a node that
        # answers everything at once only measures how fast the processes share the cores.
        interval_ms = 0.0 if concurrency == 1 else args.instant_interval_ms

        def start_node(interval_ms: float = interval_ms) -> Process:
            argv = ["--tokens", str(args.output_len), "--interval-ms", str(interval_ms)]
            program = (sys.executable, str(INSTANT_NODE))
            node = launch("instant-node", argv, workdir, node_cores, 1, program)
            wait_healthy(node)
            return node

        pair = behind_router(model, workdir, start_node, router_cores, client_cores)
        with pair as (node, router):
            targets = {"direct": node.url, "router": router.url}
            short = args.overhead_len
            lengths = sorted({short, long_len}) if concurrency == 1 else [short]
            for run in range(args.overhead_runs):
                for length in lengths:
                    row = instant_run(
                        targets, router, tokenizer, args, rng, length, concurrency, run
                    )
                    rows.setdefault(f"{length} tokens, c={concurrency}", []).append(row)
                    print(f"(d) {length} tokens, c={concurrency}: {row}", flush=True)
    summary = {
        key: {
            name: statistics.median(r[name] for r in runs)
            for name in runs[0]
            if name not in ("run", "requests", "errors")
        }
        | {"errors": sum(r["errors"] for r in runs)}
        for key, runs in rows.items()
    }
    return {"runs": rows, "summary": summary, "client_cores": args.instant_client}


def instant_run(
    targets: dict[str, str],
    router: Process,
    tokenizer: Any,
    args: argparse.Namespace,
    rng: random.Random,
    length: int,
    concurrency: int,
    run: int,
) -> dict[str, Any]:
    """One run of (d): warm-up, then the requests direct and routed; at concurrency 1 taking
    turns (``added_ms`` is the median of each routed request against the direct one before
    it), above it one closed loop each, the first alternating (the difference of p50s)."""
    warm = random_texts(tokenizer, max(8, concurrency), length, rng)
    for url in targets.values():
        asyncio.run(closed_loop(url, warm, concurrency, args.output_len))
    before = router.metrics()
    if concurrency == 1:
        prompts = random_texts(tokenizer, 2 * args.instant_requests, length, rng)
        results = asyncio.run(taking_turns(targets, prompts, args.output_len))
        direct, routed = results["direct"], results["router"]
        paired = [1e3 * (r - d) for d, r in zip(direct.ttft_s, routed.ttft_s, strict=False)]
        added = statistics.median(paired)
    else:
        # Clients staggered over one request's duration, so that requests arrive spread out
        # as from independent users, not in bursts of 32 (each of which queues behind the
        # others wherever it goes).
        stagger_s = args.output_len * args.instant_interval_ms / 1e3 / concurrency
        results = {}
        for name in list(targets) if run % 2 == 0 else list(reversed(targets)):
            prompts = random_texts(tokenizer, args.instant_requests, length, rng)
            results[name] = asyncio.run(
                closed_loop(targets[name], prompts, concurrency, args.output_len, stagger_s)
            )
        direct, routed = results["direct"], results["router"]
        added = 1e3 * (statistics.median(routed.ttft_s) - statistics.median(direct.ttft_s))
    after = router.metrics()
    name = "pagedllm:router_added_latency_seconds"
    count = after[f"{name}_count"] - before[f"{name}_count"]
    return {
        "run": run,
        "requests": len(routed.ttft_s),
        "errors": direct.errors + routed.errors,
        "direct_ttft_p50_ms": 1e3 * statistics.median(direct.ttft_s),
        "router_ttft_p50_ms": 1e3 * statistics.median(routed.ttft_s),
        "added_ms": added,
        "before_forward_ms": 1e3 * (after[f"{name}_sum"] - before[f"{name}_sum"]) / max(count, 1),
        "direct_tokens_per_s": direct.summary()["output_tokens_per_s"],
        "router_tokens_per_s": routed.summary()["output_tokens_per_s"],
    }


# ----- output --------------------------------------------------------------------------------


def plot(data: dict[str, Any], name: str) -> Path:
    fig, axes = common.new_figure(ncols=3, width=5.0)
    if "shared_prefix" in data:
        runs = data["shared_prefix"]["runs"]
        names = list(runs)
        ax = axes[0]
        rates = [100 * (runs[n]["prefix_hit_rate"] or 0) for n in names]
        bars = ax.bar(
            names, rates, color=["tab:green", "tab:red", "tab:orange", "tab:grey"][: len(names)]
        )
        for bar, v in zip(bars, rates, strict=True):
            ax.annotate(
                f"{v:.0f}%", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom"
            )
        ax.set_ylabel("prefix cache hit rate (% of prompt tokens)")
        ax.set_title("Cluster prefix hit rate")
        ax = axes[1]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], [runs[n]["ttft_p50_ms"] or 0 for n in names], 0.4, label="p50")
        ax.bar([i + 0.2 for i in x], [runs[n]["ttft_p99_ms"] or 0 for n in names], 0.4, label="p99")
        ax.set_xticks(list(x), names)
        ax.set_ylabel("time to first token (ms)")
        ax.set_yscale("log")
        ax.set_title("TTFT, closed loop")
        ax.legend(fontsize=8)
    if "instant" not in data:
        axes[2].set_axis_off()
        axes[2].text(0.5, 0.5, "router cost (d): not in this run", ha="center", va="center")
    else:
        ax = axes[2]
        summary = data["instant"]["summary"]
        ax.bar(list(summary), [s["added_ms"] for s in summary.values()], color="tab:blue")
        ax.axhline(TARGET_ADDED_TTFT_MS, color="grey", lw=0.8, ls="--", label="target")
        ax.set_ylabel("added p50 TTFT through the router (ms)")
        ax.set_title("Router cost (stand-in node)")
        ax.tick_params(axis="x", labelsize=7)
        ax.legend(fontsize=8)
    return common.save_figure(fig, name)


def targets_of(data: dict[str, Any]) -> list[common.Target]:
    targets = []
    runs = data.get("shared_prefix", {}).get("runs", {})
    if "prefix" in runs and "one node" in runs:
        share = runs["prefix"]["prefix_hit_rate"] / runs["one node"]["prefix_hit_rate"]
        targets.append(common.Target("cluster hit rate / one node's", share, TARGET_HIT_RATE_SHARE))
    if "prefix" in runs and "random" in runs:
        gain = runs["random"]["ttft_p50_ms"] / runs["prefix"]["ttft_p50_ms"]
        targets.append(common.Target("TTFT p50 gain over random", gain, TARGET_TTFT_GAIN, unit="x"))
    if "uniform" in data:
        targets.append(
            common.Target(
                "busiest node's share / mean (uniform)",
                data["uniform"]["busiest_share"],
                TARGET_BUSIEST_SHARE,
                at_most=True,
            )
        )
    for concurrency, s in data.get("overhead", {}).get("summary", {}).items():
        targets.append(
            common.Target(
                f"throughput loss at c={concurrency}",
                s["throughput_loss"],
                TARGET_THROUGHPUT_LOSS,
                at_most=True,
            )
        )
    overhead_len = data["settings"]["overhead_len"]
    for key, s in data.get("instant", {}).get("summary", {}).items():
        if key.startswith(f"{overhead_len} tokens,"):
            targets.append(
                common.Target(
                    f"added p50 TTFT, {key} (d)",
                    s["added_ms"],
                    TARGET_ADDED_TTFT_MS,
                    at_most=True,
                    unit=" ms",
                )
            )
    return targets


# Table columns: header -> key in a part's summary.
OVERHEAD_COLUMNS = {
    "direct TTFT p50": "direct_ttft_p50_ms",
    "router TTFT p50": "router_ttft_p50_ms",
    "added ms": "added_ttft_p50_ms",
    "added, paired median": "paired_added_ttft_ms",
    "direct tok/s": "direct_tokens_per_s",
    "router tok/s": "router_tokens_per_s",
    "loss": "throughput_loss",
    "router CPU ms/request": "router_cpu_ms_per_request",
}
INSTANT_COLUMNS = {
    "direct TTFT p50": "direct_ttft_p50_ms",
    "router TTFT p50": "router_ttft_p50_ms",
    "added": "added_ms",
    "router before forwarding": "before_forward_ms",
    "direct tok/s": "direct_tokens_per_s",
    "router tok/s": "router_tokens_per_s",
    "errors": "errors",
}


def print_summary(
    first: str, columns: dict[str, str], summary: dict[Any, dict[str, Any]], title: str
) -> None:
    """One row per key of ``summary``: the key, then each column's value (header: key)."""
    common.print_table(
        [first, *columns],
        [[key, *(row.get(name, "–") for name in columns.values())] for key, row in summary.items()],
        title=title,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--parts",
        default="a,b,c,d",
        help="a (shared prefixes), b (balance), c (cost), d (added latency, stand-in node)",
    )
    parser.add_argument("--model", help="model directory (default: the benchmark model)")
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--policies", default="prefix,random,round-robin")
    parser.add_argument("--prompts", type=int, default=8, help="system prompts")
    parser.add_argument("--system-len", type=int, default=1024)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument(
        "--cache-prompts", type=float, default=3.0, help="prompts one node's KV holds"
    )
    parser.add_argument("--warmup", type=int, default=24)
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument(
        "--load-bound", type=float, help="the router's --load-bound (default: the router's own)"
    )
    parser.add_argument("--no-one-node", dest="one_node", action="store_false")
    parser.add_argument("--uniform-requests", type=int, default=120)
    parser.add_argument("--uniform-len", type=int, default=128)
    parser.add_argument("--overhead-concurrency", default="1,32")
    parser.add_argument("--overhead-runs", type=int, default=3)
    parser.add_argument(
        "--overhead-cores",
        choices=("split", "shared"),
        default="split",
        help="(c): the router (and load generator) on a core of its own, or on the node's",
    )
    parser.add_argument("--overhead-len", type=int, default=64)
    parser.add_argument(
        "--overhead-min-requests",
        type=int,
        default=32,
        help="(c): requests per target and run, at least (and 4 times the concurrency)",
    )
    parser.add_argument(
        "--instant-requests",
        type=int,
        default=200,
        help="(d): requests per target, prompt length and run",
    )
    parser.add_argument(
        "--instant-client",
        choices=("node", "router"),
        default="node",
        help="(d): the load generator on the stand-in node's core, or on the router's",
    )
    parser.add_argument(
        "--instant-interval-ms",
        type=float,
        default=30.0,
        help="(d), above concurrency 1: the stand-in's time between a stream's tokens",
    )
    parser.add_argument("--name", default="fleet")
    args = parser.parse_args()
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    args.overhead_concurrency = [int(c) for c in args.overhead_concurrency.split(",")]
    parts = {p.strip() for p in args.parts.split(",")}

    from transformers import AutoTokenizer

    common.warn_if_busy()
    model = common.resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    data: dict[str, Any] = {
        "benchmark": "fleet",
        "machine": common.machine_info(),
        "model": common.model_summary(model),
        "settings": {k: v for k, v in vars(args).items() if k != "parts"}
        | {"parts": sorted(parts)},
    }
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pagedllm-fleet-") as tmp:
        workdir = Path(tmp)
        if "a" in parts:
            data["shared_prefix"] = part_a(args, model, tokenizer, workdir)
            runs = data["shared_prefix"]["runs"]
            common.print_table(
                [
                    "policy",
                    "hit rate",
                    "TTFT p50 ms",
                    "TTFT p99 ms",
                    "tok/s",
                    "requests per node",
                    "errors",
                ],
                [
                    [
                        name,
                        f"{(r['prefix_hit_rate'] or 0):.1%}",
                        r["ttft_p50_ms"],
                        r["ttft_p99_ms"],
                        r["output_tokens_per_s"],
                        " ".join(f"{v:.0f}" for v in r["requests_per_node"]),
                        r["errors"],
                    ]
                    for name, r in runs.items()
                ],
                title=f"(a) {args.prompts} system prompts of {args.system_len} tokens, "
                f"{args.requests} requests at concurrency {args.concurrency}",
            )
        if "b" in parts:
            data["uniform"] = part_b(args, model, tokenizer, workdir)
            u = data["uniform"]
            print(
                f"\n(b) uniform: requests per node {u['requests_per_node']}, "
                f"busiest / mean {u['busiest_share']:.2f}"
            )
        if "c" in parts:
            data["overhead"] = part_c(args, model, tokenizer, workdir)
            print_summary(
                "concurrency",
                OVERHEAD_COLUMNS,
                data["overhead"]["summary"],
                f"(c) the router's cost (medians of interleaved runs; cores {args.overhead_cores})",
            )
        if "d" in parts:
            data["instant"] = part_d(args, model, tokenizer, workdir)
            print_summary(
                "prompt, concurrency",
                INSTANT_COLUMNS,
                data["instant"]["summary"],
                "(d) the router's added time to first token, against a stand-in node "
                f"(ms, medians of interleaved runs; load generator on the "
                f"{args.instant_client}'s core)",
            )
    data["duration_s"] = time.monotonic() - started
    targets = targets_of(data)
    common.print_targets(targets)
    data["targets"] = [t.to_json() for t in targets]
    data["machine"]["load_average_1m_at_end"] = os.getloadavg()[0]
    path = common.write_json(args.name, data)
    print(f"\nwrote {path} and {plot(data, args.name)}")


if __name__ == "__main__":
    main()
