"""A stand-in for a Service's cluster IP (test infrastructure): for each port of each Service
of one namespace, a loopback listener that spreads connections over the Service's ready
endpoints, as kube-proxy does.

Endpoints are the pods the Service's selector matches that are Ready and not terminating
(what the EndpointSlice controller publishes); the target port (a name or a number) is looked
up in the pod's containers and mapped to the loopback port the kubelet stand-in gave it.
Balancing is per connection, round robin; a connection that arrives while no endpoint is
ready is closed at once (a real cluster refuses it). Closing a listener when its Service is
deleted leaves established connections to finish, as in a real cluster.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedllm.operator.kube import KubeClient
from pagedllm_testing.deployment_standin import is_pod_ready
from pagedllm_testing.kubelet_standin import HOST_PORTS_ANNOTATION, LOOPBACK

CHUNK = 64 * 1024


def selects(selector: Mapping[str, str], pod: Mapping[str, Any]) -> bool:
    labels = pod["metadata"].get("labels") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def endpoint_port(pod: Mapping[str, Any], target_port: int | str) -> int | None:
    """The loopback port serving `target_port` of this pod, if it has one."""
    container_port: int | None
    if isinstance(target_port, int) or str(target_port).isdigit():
        container_port = int(target_port)
    else:
        container_port = next(
            (
                p["containerPort"]
                for c in pod["spec"].get("containers") or []
                for p in c.get("ports") or []
                if p.get("name") == target_port
            ),
            None,
        )
    host_ports = json.loads(
        pod["metadata"].get("annotations", {}).get(HOST_PORTS_ANNOTATION) or "{}"
    )
    port = host_ports.get(str(container_port))
    return int(port) if port is not None else None


def ready_endpoints(
    service: Mapping[str, Any], service_port: Mapping[str, Any], pods: list[dict[str, Any]]
) -> list[tuple[str, int]]:
    selector = service["spec"].get("selector") or {}
    target = service_port.get("targetPort", service_port["port"])
    endpoints = []
    for pod in pods:
        if selects(selector, pod) and is_pod_ready(pod):
            port = endpoint_port(pod, target)
            if port is not None:
                endpoints.append((LOOPBACK, port))
    return sorted(endpoints)


@dataclass
class PortProxy:
    service: str
    port_name: str
    endpoints: list[tuple[str, int]] = field(default_factory=list)
    server: asyncio.Server | None = None
    connections: int = 0
    # Connections passed to an endpoint that refused them (a pod whose process died, until
    # the Service drops it).
    refused: int = 0
    _turn: itertools.count[int] = field(default_factory=itertools.count)
    _handlers: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.sockets[0].getsockname()[1]

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._accept, LOOPBACK, 0)

    async def close(self) -> None:
        """Stop listening; established connections go on (as when a Service is deleted)."""
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def cut(self) -> None:
        """End every established connection (the cluster is going away)."""
        for handler in self._handlers:
            handler.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _accept(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        try:
            await self._forward(client_reader, client_writer)
        finally:
            self._handlers.discard(handler)

    async def _forward(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        endpoints = list(self.endpoints)
        if not endpoints:
            client_writer.close()
            return
        host, port = endpoints[next(self._turn) % len(endpoints)]
        try:
            pod_reader, pod_writer = await asyncio.open_connection(host, port)
        except OSError:
            self.refused += 1
            client_writer.close()
            return
        self.connections += 1
        upstream = asyncio.ensure_future(_copy(client_reader, pod_writer))
        try:
            # The pod's side ending (its response done and the connection closed, or the pod
            # gone) ends the client's connection too.
            await _copy(pod_reader, client_writer)
        finally:
            upstream.cancel()
            await asyncio.gather(upstream, return_exceptions=True)
            for writer in (pod_writer, client_writer):
                writer.close()


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One direction, passing on the end of the stream as a half-close."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


class ServiceProxies:
    """One PortProxy per Service port of the namespace, kept in step with the API."""

    def __init__(self, kube: KubeClient, namespace: str):
        self.kube = kube
        self.namespace = namespace
        self.proxies: dict[tuple[str, str], PortProxy] = {}

    def url(self, service: str, port_name: str = "http") -> str | None:
        proxy = self.proxies.get((service, port_name))
        return f"http://{LOOPBACK}:{proxy.port}" if proxy is not None else None

    def proxy(self, service: str, port_name: str = "http") -> PortProxy | None:
        return self.proxies.get((service, port_name))

    async def sync(self) -> None:
        services = await self.kube.list("v1", "Service", self.namespace)
        pods = await self.kube.list("v1", "Pod", self.namespace)
        wanted = set()
        for service in services:
            for service_port in service["spec"].get("ports") or []:
                key = (service["metadata"]["name"], service_port.get("name") or "")
                wanted.add(key)
                proxy = self.proxies.get(key)
                if proxy is None:
                    proxy = self.proxies[key] = PortProxy(*key)
                    await proxy.start()
                proxy.endpoints = ready_endpoints(service, service_port, pods)
        for key in [k for k in self.proxies if k not in wanted]:
            await self.proxies.pop(key).close()

    async def close(self) -> None:
        for proxy in self.proxies.values():
            await proxy.close()
            await proxy.cut()
        self.proxies.clear()
