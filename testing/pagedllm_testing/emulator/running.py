"""Running the emulator: a kubeconfig for it, in-process on a thread (for tests), or as
`python -m pagedllm_testing.emulator --port P --kubeconfig FILE`."""

from __future__ import annotations

import argparse
import asyncio
import signal
import threading
from pathlib import Path
from typing import Any

import yaml

from pagedllm_testing.emulator.server import EmulatorServer
from pagedllm_testing.emulator.store import KubeEmulator


def kubeconfig_text(server_url: str, namespace: str = "default") -> str:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulator", "cluster": {"server": server_url}}],
        "users": [{"name": "emulator", "user": {"token": "emulator"}}],
        "contexts": [
            {
                "name": "emulator",
                "context": {"cluster": "emulator", "user": "emulator", "namespace": namespace},
            }
        ],
        "current-context": "emulator",
    }
    return yaml.safe_dump(config)


class EmulatorThread:
    """The emulator on a loopback port, served from a thread (for tests)."""

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, *, bookmark_interval: float = 30.0
    ) -> None:
        self.host, self.port = host, port
        self.server = EmulatorServer(bookmark_interval=bookmark_interval)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="kube-emulator", daemon=True
        )
        self.url = ""

    def __enter__(self) -> EmulatorThread:
        self.thread.start()
        self.url = self.call(self.server.start(self.host, self.port))
        return self

    def __exit__(self, *exc: object) -> None:
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    def call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=30)

    @property
    def emulator(self) -> KubeEmulator:
        return self.server.emulator


async def _serve_forever(host: str, port: int, kubeconfig: Path | None) -> None:
    server = EmulatorServer()
    url = await server.start(host, port)
    if kubeconfig is not None:
        kubeconfig.write_text(kubeconfig_text(url))
    print(f"kube emulator listening on {url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pagedllm_testing.emulator",
        description="A Kubernetes API server emulator on loopback, for kubectl and kopf.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--kubeconfig", type=Path, help="write a kubeconfig for this server")
    args = parser.parse_args(argv)
    asyncio.run(_serve_forever(args.host, args.port, args.kubeconfig))
    return 0
