"""Start-up: how long ``pagedllm serve`` takes to answer ``/health``, from an empty cache and
again with it.

    python bench/startup.py [--model smollm2] [--warm-starts 2] [--threads 2]

A cold start gets an empty cache directory (``PAGEDLLM_CACHE_DIR``): the C++ CPU kernels
(attention, the layers' elementwise passes, the matmuls and the decode graph: everything the
engine compiles) are built into it, and the demo model is written there. The warm starts that
follow reuse both. Each start runs until ``/health`` answers 200, which the worker reports only
after its warm-up step; the server is then stopped. Nothing here is timed by a test.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import common

TARGET_SECONDS = 30.0
TIMEOUT = 600.0


def time_to_health(cache: Path, model: str | None, threads: int, log: Path) -> float:
    """Seconds from starting ``pagedllm serve`` to its first 200 on ``/health``."""
    port = common.free_port()
    command = [str(Path(sys.executable).with_name("pagedllm")), "serve", "--port", str(port)]
    if model is not None:
        command += ["--model", model]
    env = os.environ | {
        "PAGEDLLM_CACHE_DIR": str(cache),
        "OMP_NUM_THREADS": str(threads),
    }
    env.pop("PAGEDLLM_KERNEL_DIR", None)  # the kernels go under the cache directory
    start = time.monotonic()
    with log.open("w") as out:
        # Outside the repository: its ``operator/`` folder would shadow the standard library.
        proc = subprocess.Popen(
            command,
            env=env,
            cwd=tempfile.gettempdir(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"pagedllm serve exited with {proc.returncode}; see {log}")
            try:
                url = f"http://127.0.0.1:{port}/health"
                with urllib.request.urlopen(url, timeout=5) as response:
                    if response.status == 200:
                        return time.monotonic() - start
            except OSError:  # not listening yet, or 503 while it starts
                pass
            if time.monotonic() - start > TIMEOUT:
                raise RuntimeError(f"no /health within {TIMEOUT} s; see {log}")
            time.sleep(0.1)
    finally:
        common.stop_process(proc, timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", help="a model as `pagedllm serve --model` takes it (default: demo)"
    )
    parser.add_argument("--warm-starts", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--name", default="startup")
    args = parser.parse_args()
    common.warn_if_busy()
    workdir = Path(tempfile.mkdtemp(prefix="pagedllm-startup-"))
    cache = workdir / "cache"
    try:
        cold = time_to_health(cache, args.model, args.threads, workdir / "cold.log")
        built = sorted(p.name for p in (cache / "kernels").glob("*/*.so"))
        warm = [
            time_to_health(cache, args.model, args.threads, workdir / f"warm-{i}.log")
            for i in range(args.warm_starts)
        ]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    rows = [("cold (empty cache)", round(cold, 1))]
    rows += [(f"warm {i + 1}", round(t, 1)) for i, t in enumerate(warm)]
    common.print_table(
        ["start", "seconds to /health"], rows, f"pagedllm serve, {args.model or 'demo model'}"
    )
    print(f"built into the empty cache: {', '.join(built) or 'nothing'}")
    targets = [
        common.Target("cold start (kernels built) to /health", cold, TARGET_SECONDS, True, " s"),
        common.Target(
            "warm start (cache reused) to /health", max(warm), TARGET_SECONDS, True, " s"
        ),
    ]
    common.print_targets(targets)
    data = {
        "benchmark": "startup",
        "machine": common.machine_info(),
        "model": args.model or "demo",
        "threads": args.threads,
        "cold_s": cold,
        "warm_s": warm,
        "built": built,
        "targets": [t.to_json() for t in targets],
    }
    path = common.write_json(args.name, data)
    fig, (ax,) = common.new_figure()
    ax.bar([r[0] for r in rows], [r[1] for r in rows], color="tab:blue")
    ax.axhline(TARGET_SECONDS, color="tab:red", linestyle="--", label="target")
    ax.set_ylabel("seconds to /health")
    ax.set_title("pagedllm serve start-up")
    ax.legend()
    png = common.save_figure(fig, args.name)
    print(f"\nwrote {path} and {png}")


if __name__ == "__main__":
    main()
