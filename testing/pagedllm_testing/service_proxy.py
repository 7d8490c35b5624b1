"""A stand-in for kube-proxy (test infrastructure; nothing on these machines may route a
Service's ClusterIP): for each port of each Service of one namespace, a loopback listener that
spreads connections over the Service's ready endpoints, as kube-proxy does.

Endpoints are what the real EndpointSlice controller publishes for the Service: the addresses
of its EndpointSlices whose `ready` condition is true, on the slice's port of the Service port's
name (pod addresses on the cluster's bridge). Balancing is per connection, round robin; a
connection that arrives while no endpoint is ready is closed at once (a real cluster refuses
it). Closing a listener when its Service is deleted leaves established connections to finish,
as in a real cluster.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

LOOPBACK = "127.0.0.1"
CHUNK = 64 * 1024
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def ready_endpoints(port_name: str, slices: Sequence[Mapping[str, Any]]) -> list[tuple[str, int]]:
    """(address, port) of every ready endpoint of the slices, on the port named ``port_name``."""
    endpoints = set()
    for endpoint_slice in slices:
        port = next(
            (
                p.get("port")
                for p in endpoint_slice.get("ports") or []
                if (p.get("name") or "") == port_name
            ),
            None,
        )
        if port is None:
            continue
        for endpoint in endpoint_slice.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready"):
                endpoints.update((address, int(port)) for address in endpoint["addresses"])
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
    """One PortProxy per Service port of the namespace, kept in step with the API (as an admin
    client: kube-proxy may read every Service and EndpointSlice)."""

    def __init__(self, http: httpx.AsyncClient, namespace: str):
        self.http = http
        self.namespace = namespace
        self.proxies: dict[tuple[str, str], PortProxy] = {}

    def url(self, service: str, port_name: str = "http") -> str | None:
        proxy = self.proxies.get((service, port_name))
        return f"http://{LOOPBACK}:{proxy.port}" if proxy is not None else None

    def proxy(self, service: str, port_name: str = "http") -> PortProxy | None:
        return self.proxies.get((service, port_name))

    async def _items(self, path: str) -> list[dict[str, Any]]:
        response = await self.http.get(path)
        response.raise_for_status()
        return list(response.json()["items"])

    async def sync(self) -> None:
        services = await self._items(f"/api/v1/namespaces/{self.namespace}/services")
        slices = await self._items(
            f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"
        )
        wanted = set()
        for service in services:
            name = service["metadata"]["name"]
            own = [
                s
                for s in slices
                if (s["metadata"].get("labels") or {}).get(SERVICE_NAME_LABEL) == name
            ]
            for service_port in service["spec"].get("ports") or []:
                key = (name, service_port.get("name") or "")
                wanted.add(key)
                proxy = self.proxies.get(key)
                if proxy is None:
                    proxy = self.proxies[key] = PortProxy(*key)
                    await proxy.start()
                proxy.endpoints = ready_endpoints(key[1], own)
        for key in [k for k in self.proxies if k not in wanted]:
            await self.proxies.pop(key).close()

    async def close(self) -> None:
        for proxy in self.proxies.values():
            await proxy.close()
            await proxy.cut()
        self.proxies.clear()
