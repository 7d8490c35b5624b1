"""An API server process (the tokenizer process): HTTP in, tokens to the scheduler, text out.

Several of them can share one port: each binds its own listening socket with SO_REUSEPORT
and the kernel spreads connections among them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn

from pagedllm.api.app import build_app
from pagedllm.api.engine_client import EngineClient
from pagedllm.api.serving import ServingContext
from pagedllm.ipc import sockets
from pagedllm.serve.child_process import setup_child
from pagedllm.serve.metrics import RequestMetrics

log = logging.getLogger(__name__)
# Seconds the server gives open connections when told to stop (the supervisor drains first).
STOP_GRACE_S = 5


@dataclass
class ApiServerSpec:
    index: int
    ipc_paths: sockets.IpcPaths
    tokenizer: Any  # loaded once by the supervisor, inherited through fork
    model_dir: str
    model_names: list[str]
    max_model_len: int
    vocab_size: int
    api_key: str | None
    host: str
    port: int
    log_level: str
    supervisor_pid: int
    nice: int = 0


def bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    return sock


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # SIGTERM from the supervisor: finish open responses, then exit. SIGINT stays ignored
        # (the supervisor drains on Ctrl-C).
        signal.signal(signal.SIGTERM, self.handle_exit)
        yield


def run_api_server(spec: ApiServerSpec) -> None:
    setup_child(
        f"api server {spec.index}", spec.log_level, spec.supervisor_pid, spec.ipc_paths.directory
    )
    if spec.nice:
        os.nice(spec.nice)
    try:
        sock = bind(spec.host, spec.port)
    except OSError as error:
        log.error("cannot listen on %s:%d: %s", spec.host, spec.port, error)
        sys.exit(1)
    try:
        asyncio.run(_serve(spec, sock))
    except Exception:
        log.exception("api server %d failed", spec.index)
        sys.exit(1)


async def _serve(spec: ApiServerSpec, sock: socket.socket) -> None:
    client = EngineClient(spec.ipc_paths, spec.index)
    client.start()
    ctx = ServingContext(
        client=client,
        tokenizer=spec.tokenizer,
        model_names=spec.model_names,
        model_dir=spec.model_dir,
        max_model_len=spec.max_model_len,
        vocab_size=spec.vocab_size,
        metrics=RequestMetrics(spec.model_names[0]),
    )
    config = uvicorn.Config(
        build_app(ctx, spec.api_key),
        log_config=None,
        log_level=spec.log_level,
        access_log=spec.log_level == "debug",
        timeout_graceful_shutdown=STOP_GRACE_S,
        timeout_keep_alive=30,
    )
    server = _Server(config)

    async def report_ready() -> None:
        while not server.started:
            await asyncio.sleep(0.05)
        client.report_ready()

    ready = asyncio.get_running_loop().create_task(report_ready())
    try:
        await server.serve(sockets=[sock])
    finally:
        ready.cancel()
        client.close()
