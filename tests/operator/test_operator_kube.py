"""The operator's API client (the official client's dynamic client, driven from asyncio) against
the emulator: kopf's credentials go with every call, a rotated token is picked up, errors come
out as the reconcile code expects them, and kopf's event loop keeps running during a call."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import kopf
import pytest
from aiohttp import web

from pagedllm.operator.kube import FIELD_MANAGER, ApiError, KubeClient, KubeError
from pagedllm_testing.operator_harness import EmulatorThread

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SLOW_NAME = "slow"  # the gate answers requests for this object after a delay


@dataclass
class Gate:
    """In front of the emulator: the one valid token, and what each request carried."""

    token: str = "first"
    delay: float = 0.5
    seen: list[tuple[str, str]] = field(default_factory=list)  # (Authorization, User-Agent)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        self.seen.append(
            (request.headers.get("Authorization", ""), request.headers.get("User-Agent", ""))
        )
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response(
                {"kind": "Status", "status": "Failure", "reason": "Unauthorized", "code": 401},
                status=401,
            )
        if request.path.endswith(f"/{SLOW_NAME}"):
            await asyncio.sleep(self.delay)
        return await handler(request)


@dataclass
class Login:
    """kopf's login handler: the token it hands out is the gate's, as of each login."""

    gate: Gate
    server: str
    count: int = 0

    def __call__(self) -> kopf.ConnectionInfo:
        self.count += 1
        return kopf.ConnectionInfo(server=self.server, token=self.gate.token)


@pytest.fixture(scope="module")
def gate() -> Gate:
    return Gate()


@pytest.fixture(scope="module")
def server(gate: Gate) -> Iterator[str]:
    emulator = EmulatorThread()
    emulator.server.app.middlewares.append(gate.middleware)
    with emulator:
        yield emulator.url


def config_map(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": "default"},
        "data": {"key": "value"},
    }


def test_credentials_and_a_rotated_token(gate: Gate, server: str) -> None:
    login = Login(gate, server)

    async def scenario() -> None:
        kube = KubeClient(login)
        try:
            await kube.create(config_map("rotated"))
            gate.token = "second"  # the service-account token is rotated under the pod
            live = await kube.get("v1", "ConfigMap", "rotated", "default")
            assert live is not None and live["data"] == {"key": "value"}
        finally:
            await kube.close()

    asyncio.run(scenario())
    assert login.count == 2  # logged in again after the 401, once
    assert ("Bearer first", FIELD_MANAGER) in gate.seen
    assert ("Bearer second", FIELD_MANAGER) in gate.seen


def test_errors_as_the_reconcile_code_handles_them(gate: Gate, server: str) -> None:
    async def scenario() -> None:
        kube = KubeClient(Login(gate, server))
        try:
            assert await kube.get("v1", "ConfigMap", "absent", "default") is None
            await kube.delete("v1", "ConfigMap", "absent", "default")  # already gone: fine
            await kube.create(config_map("twice"))
            with pytest.raises(ApiError) as exists:
                await kube.create(config_map("twice"))
            assert (exists.value.status, exists.value.reason) == (409, "AlreadyExists")
            with pytest.raises(ApiError) as missing:
                await kube.merge_patch("v1", "ConfigMap", "absent", "default", {"data": {}})
            assert missing.value.status == 404 and "absent" in missing.value.message
            patch = {"data": {}}
            gone = await kube.merge_patch(
                "v1", "ConfigMap", "absent", "default", patch, missing_ok=True
            )
            assert gone is None
            # A kind the server does not serve: no such object, and nothing to apply it to.
            assert await kube.get("example.com/v1", "Nothing", "x", "default") is None
            unserved = {
                "apiVersion": "example.com/v1",
                "kind": "Nothing",
                "metadata": {"name": "x"},
            }
            with pytest.raises(ApiError) as not_served:
                await kube.apply(unserved)
            assert not_served.value.status == 404 and "example.com/v1" in not_served.value.message
        finally:
            await kube.close()

    asyncio.run(scenario())


def test_an_unreachable_server_is_a_kube_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there

    async def scenario() -> None:
        kube = KubeClient(lambda: kopf.ConnectionInfo(server=f"http://127.0.0.1:{port}"))
        with pytest.raises(KubeError):
            await kube.get("v1", "ConfigMap", "any", "default")

    asyncio.run(scenario())


def test_the_event_loop_runs_while_a_call_waits(gate: Gate, server: str) -> None:
    async def scenario() -> int:
        kube = KubeClient(Login(gate, server))
        try:
            await kube.create(config_map(SLOW_NAME))
            ticks = 0

            async def tick() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.01)
                    ticks += 1

            ticker = asyncio.create_task(tick())
            await kube.get("v1", "ConfigMap", SLOW_NAME, "default")
            ticker.cancel()
            return ticks
        finally:
            await kube.close()

    # A call that blocked the loop would leave no tick to the ticker during its delay.
    assert asyncio.run(scenario()) > 0
