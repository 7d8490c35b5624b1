"""An API server process (the tokenizer process): HTTP in, tokens to the scheduler, text out.

The supervisor starts it as ``python -m pagedllm.serve.api_server_process`` with its settings
on stdin (msgpack, checked on the way in): a fresh interpreter rather than a fork of the
supervisor, which holds torch. It loads its own tokenizer and never imports torch.

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
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import msgpack
import uvicorn

from pagedllm.api import event_loop
from pagedllm.api.app import build_app
from pagedllm.api.chat_settings import ChatSettings
from pagedllm.api.engine_client import EngineClient
from pagedllm.api.limits import RequestLimits
from pagedllm.api.serving import ServingContext
from pagedllm.api.token_bytes import max_token_bytes
from pagedllm.core.lora_request import LoRARequest
from pagedllm.ipc import sockets
from pagedllm.ipc.codec import WireError, decoder, encoder
from pagedllm.models import ModelLoadError
from pagedllm.models.tokenizer import load_tokenizer
from pagedllm.runtime.adapter_file import AdapterFileWatcher, Answer
from pagedllm.runtime.child_process import forbid_torch, setup_child
from pagedllm.runtime.metrics import RequestRecorder

log = logging.getLogger(__name__)
# Seconds the server gives open connections when told to stop (the supervisor drains first).
CONNECTIONS_GRACE_S = 5


@dataclass
class ApiServerSpec:
    index: int
    ipc_paths: sockets.IpcPaths
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
    limits: RequestLimits = field(default_factory=RequestLimits)
    tokenizer_dir: str = ""  # where the tokenizer is, when not in model_dir (--tokenizer)
    chat: ChatSettings = field(default_factory=ChatSettings)
    otlp_traces_endpoint: str | None = None  # --otlp-traces-endpoint
    lora_modules: dict[str, str] = field(default_factory=dict)  # --lora-modules
    runtime_lora_updates: bool = False  # --allow-runtime-lora-updating
    lora_modules_file: str | None = None  # --lora-modules-file, watched by this server


def adapter_requests(modules: dict[str, str]) -> dict[str, LoRARequest]:
    """The request each adapter name means (ids in name order, as vLLM numbers them from 1)."""
    return {
        name: LoRARequest(name, i + 1, path)
        for i, (name, path) in enumerate(sorted(modules.items()))
    }


def encode_spec(spec: ApiServerSpec) -> bytes:
    return msgpack.packb(encoder(ApiServerSpec)(spec))


def decode_spec(data: bytes) -> ApiServerSpec:
    """The spec the supervisor wrote; raises WireError when ``data`` is not one."""
    try:
        value = msgpack.unpackb(data)
    except Exception as error:  # msgpack raises several unrelated types on bad input
        raise WireError(f"not msgpack: {error}") from None
    spec: ApiServerSpec = decoder(ApiServerSpec)(value)
    return spec


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


def main(stdin: BinaryIO) -> None:
    """Entry point: the spec from ``stdin``, then serve until told to stop."""
    forbid_torch()
    try:
        spec = decode_spec(stdin.read())
    except WireError as error:
        print(f"pagedllm api server: invalid spec on stdin: {error}", file=sys.stderr)
        sys.exit(2)
    code = run_api_server(spec)
    logging.shutdown()
    # Without the interpreter's teardown, which takes seconds of CPU over transformers' many
    # modules and has nothing left to close: the sockets are, and the metrics are on disk.
    os._exit(code)


def run_api_server(spec: ApiServerSpec) -> int:
    """Serve until SIGTERM; the exit status."""
    setup_child(
        f"api server {spec.index}", spec.log_level, spec.supervisor_pid, spec.ipc_paths.directory
    )
    if spec.nice:
        os.nice(spec.nice)
    try:
        tokenizer = load_tokenizer(spec.tokenizer_dir or spec.model_dir)
    except ModelLoadError as error:
        log.error("%s", error)
        return 1
    try:
        sock = bind(spec.host, spec.port)
    except OSError as error:
        log.error("cannot listen on %s:%d: %s", spec.host, spec.port, error)
        return 1
    try:
        event_loop.run(_serve(spec, sock, tokenizer))
    except Exception:
        log.exception("api server %d failed", spec.index)
        return 1
    return 0


async def _serve(spec: ApiServerSpec, sock: socket.socket, tokenizer: Any) -> None:
    tracer = None
    if spec.otlp_traces_endpoint:
        from pagedllm.runtime.tracing import RequestTracer

        tracer = RequestTracer(spec.otlp_traces_endpoint)
    client = EngineClient(spec.ipc_paths, spec.index)
    client.start()
    ctx = ServingContext(
        client=client,
        tokenizer=tokenizer,
        model_names=spec.model_names,
        adapters=adapter_requests(spec.lora_modules),
        model_dir=spec.model_dir,
        max_model_len=spec.max_model_len,
        vocab_size=spec.vocab_size,
        metrics=RequestRecorder(spec.model_names[0], tracer, spec.lora_modules),
        limits=spec.limits,
        max_token_bytes=max_token_bytes(tokenizer),
        chat=spec.chat,
        runtime_lora_updates=spec.runtime_lora_updates,
    )

    def adapters_changed(adapters: dict[str, str]) -> None:
        ctx.adapters = adapter_requests(adapters)

    client.on_adapters = adapters_changed
    watcher = adapter_watcher(spec, client)
    config = uvicorn.Config(
        build_app(ctx, spec.api_key),
        log_config=None,
        log_level=spec.log_level,
        access_log=spec.log_level == "debug",
        timeout_graceful_shutdown=CONNECTIONS_GRACE_S,
        timeout_keep_alive=30,
    )
    server = _Server(config)

    async def report_ready() -> None:
        while not server.started:
            await asyncio.sleep(0.05)
        if watcher is not None:
            # Readiness includes the preload adapters (a broken one keeps the node unready).
            await watcher.preloaded.wait()
        client.report_ready()

    loop = asyncio.get_running_loop()
    ready = loop.create_task(report_ready())
    watching = loop.create_task(watcher.run()) if watcher is not None else None
    try:
        await server.serve(sockets=[sock])
    finally:
        ready.cancel()
        if watching is not None:
            watching.cancel()
        client.close()
        if tracer is not None:
            tracer.shutdown()


def adapter_watcher(spec: ApiServerSpec, client: EngineClient) -> AdapterFileWatcher | None:
    """The watcher of --lora-modules-file, updating adapters through the scheduler as the
    runtime endpoints do (this server only, see the supervisor)."""
    if spec.lora_modules_file is None:
        return None

    async def update(name: str, path: str | None) -> Answer:
        answer = await client.update_adapter(name, path)
        return Answer(answer.status, answer.message)

    return AdapterFileWatcher(spec.lora_modules_file, update)


if __name__ == "__main__":
    main(sys.stdin.buffer)
