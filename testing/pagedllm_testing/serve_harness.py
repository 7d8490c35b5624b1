"""Starting the real `pagedllm serve` for tests, and reading what it exposes."""

from __future__ import annotations

import glob
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

PAGEDLLM = str(Path(sys.executable).with_name("pagedllm"))
DEMO_MODEL = "pagedllm-demo"
START_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    tmp_dir: Path
    api_key: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kwargs: object) -> openai.OpenAI:
        kwargs.setdefault("api_key", self.api_key or "unused")
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 120)
        return openai.OpenAI(base_url=f"{self.url}/v1", **kwargs)

    def async_client(self, **kwargs: object) -> openai.AsyncOpenAI:
        kwargs.setdefault("api_key", self.api_key or "unused")
        kwargs.setdefault("max_retries", 0)
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", timeout=120, **kwargs)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def pid(self, role: str) -> int:
        """The pid of a child as its log lines name it: ``worker 1``, ``api server 0``..."""
        match = re.search(rf"\[{role} pid (\d+)\]", self.log())
        assert match, self.log()
        return int(match.group(1))

    def socket_path(self, name: str) -> str:
        """The node's ZeroMQ socket ``name`` (its private directory is under our TMPDIR)."""
        (path,) = glob.glob(str(self.tmp_dir / "pagedllm-*" / name))
        return path

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics: name{label="v",...} -> value."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}"] = sample.value
        return samples

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples named ``name`` whose labels include ``labels``."""
        wanted = [f'{k}="{v}"' for k, v in labels.items()]
        return sum(
            value
            for key, value in self.metrics().items()
            if key.split("{", 1)[0] == name and all(w in key for w in wanted)
        )

    def health(self) -> int:
        try:
            return httpx.get(f"{self.url}/health", timeout=5).status_code
        except httpx.HTTPError:
            return 0

    def wait_until(self, predicate, timeout: float = 30.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}\n{self.log()[-3000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def start_server(
    tmp_dir: Path,
    *args: str,
    api_key: str | None = None,
    env: dict[str, str] | None = None,
    port: int | None = None,
    wait_ready: bool = True,
) -> Server:
    """`pagedllm serve` on a free port with a small KV cache, once /health answers 200 (at
    once without `wait_ready`)."""
    return start_command(
        tmp_dir,
        "serve",
        "--kv-cache-memory",
        "32MiB",
        *args,
        api_key=api_key,
        env=env,
        port=port,
        wait_ready=wait_ready,
    )


def start_command(
    tmp_dir: Path,
    command: str,
    *args: str,
    api_key: str | None = None,
    env: dict[str, str] | None = None,
    port: int | None = None,
    wait_ready: bool = True,
) -> Server:
    """`pagedllm COMMAND` (serve, router) on ``port`` (default: a free one), once /health
    answers 200 (at once without `wait_ready`)."""
    tmp_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    log_path = tmp_dir / f"{command}.log"
    full_env = {**os.environ, "TMPDIR": str(tmp_dir), **(env or {})}
    argv = [PAGEDLLM, command, "--host", "127.0.0.1", "--port", str(port), *args]
    if api_key is not None:
        argv += ["--api-key", api_key]
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            argv, stdout=log_file, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
    server = Server(process, port, log_path, tmp_dir, api_key)
    deadline = time.monotonic() + START_TIMEOUT_S
    while wait_ready and server.health() != 200:
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise AssertionError(f"pagedllm {command} did not become ready:\n{server.log()}")
        time.sleep(0.2)
    return server


def oversized_chunks(model: str = "errors-model") -> Iterator[bytes]:
    """A completion request's body just over the 8 MiB body limit, in 1 MiB chunks (sent so,
    it has no Content-Length: the server must count it as it arrives)."""
    yield b'{"model": "' + model.encode() + b'", "prompt": "'
    for _ in range(8):
        yield b"a" * (1 << 20)
    yield b"a" * 65536 + b'"}'


TORCH_LIBRARY = re.compile(r"/(libtorch[^/]*|libc10[^/]*|torch/_C[^/]*)$")


def mapped_files(pid: int) -> set[str]:
    """The files process ``pid`` has mapped: its libraries and extension modules."""
    with open(f"/proc/{pid}/maps") as maps:
        fields = [line.split(maxsplit=5) for line in maps]
    return {f[5].strip() for f in fields if len(f) == 6 and f[5].startswith("/")}


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PAGEDLLM, *args], capture_output=True, text=True, timeout=timeout)
