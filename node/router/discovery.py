"""Kubernetes discovery of the serving pods a router sends requests to.

The source of truth is the EndpointSlices of the serving pods' own Service (the operator's
`NAME-serving`): the same ready endpoints kube-proxy sends a Service's traffic to, from the
EndpointSlice controller, which already folds in readiness, termination and named target
ports. Reading them needs no access to Pods (whose specs may carry secrets in env values).

The `kubernetes` package is synchronous: one daemon thread lists the slices, then watches
them from the listed resourceVersion, and hands every new set of URLs to the event loop. A
watch that the API server ends is resumed where it stopped; one that expired (410 Gone) or
failed starts over with a fresh list (with a capped back-off while the API is unreachable).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import kubernetes.client
import kubernetes.config
import urllib3
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException
from kubernetes.watch.watch import iter_resp_lines

logger = logging.getLogger(__name__)

# The label the EndpointSlice controller puts on every slice of a Service.
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
USER_AGENT = "pagedllm-router"
DEFAULT_PORT_NAME = "http"
GONE = 410


class DiscoveryError(Exception):
    """Discovery cannot start as configured (no credentials, a bad target)."""


@dataclass(frozen=True)
class DiscoveryTarget:
    """Which Service's endpoints to follow, and which of its ports serves the API."""

    namespace: str
    service: str
    port_name: str = DEFAULT_PORT_NAME

    @property
    def label_selector(self) -> str:
        return f"{SERVICE_NAME_LABEL}={self.service}"


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def _objects(value: Any) -> list[Mapping[str, Any]]:
    """The mappings of a list field, anything else dropped (an API server validates slices;
    a malformed one must still not stop discovery)."""
    return [item for item in value if isinstance(item, Mapping)] if isinstance(value, list) else []


def slice_urls(endpoint_slice: Mapping[str, Any], port_name: str) -> set[str]:
    """The URLs of one slice's ready endpoints on the named port.

    A nil `ready` counts as ready (the API's advice for an unknown state); of an endpoint's
    addresses only the first is used (they are fungible). A slice without the port serves
    nothing here."""
    port = next(
        (
            p.get("port")
            for p in _objects(endpoint_slice.get("ports"))
            if (p.get("name") or "") == port_name
        ),
        None,
    )
    if (
        not isinstance(port, int)
        or isinstance(port, bool)
        or not 0 < port < 65536
        or endpoint_slice.get("addressType") not in ("IPv4", "IPv6", "FQDN")
    ):
        return set()
    urls = set()
    for endpoint in _objects(endpoint_slice.get("endpoints")):
        addresses = endpoint.get("addresses")
        conditions = endpoint.get("conditions")
        ready = conditions.get("ready") if isinstance(conditions, Mapping) else None
        if isinstance(addresses, list) and addresses and isinstance(addresses[0], str):
            if ready is not False:
                urls.add(f"http://{_host(addresses[0])}:{port}")
    return urls


def ready_urls(slices: Iterable[Mapping[str, Any]], port_name: str) -> list[str]:
    """Every ready endpoint of the Service, once each (a pod may sit in two slices while the
    controller moves it), sorted."""
    urls: set[str] = set()
    for endpoint_slice in slices:
        urls |= slice_urls(endpoint_slice, port_name)
    return sorted(urls)


def load_api_client() -> kubernetes.client.ApiClient:
    """Credentials as a pod has them (its service account), else from the kubeconfig
    ($KUBECONFIG or ~/.kube/config), for a router run outside the cluster."""
    configuration = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    except ConfigException:
        try:
            # Read now, not at the library's import: the environment may have changed since.
            kubernetes.config.load_kube_config(
                config_file=os.environ.get("KUBECONFIG", "~/.kube/config"),
                client_configuration=configuration,
            )
        except (ConfigException, OSError) as error:
            raise DiscoveryError(
                "no Kubernetes credentials: not in a pod with a service account token, "
                f"and no usable kubeconfig ({error})"
            ) from None
    client = kubernetes.client.ApiClient(configuration)
    # Named in the apiserver's audit log and metrics, as the operator names itself.
    client.user_agent = USER_AGENT
    return client


class _Expired(Exception):
    """The watch's resourceVersion is too old: list again."""


class EndpointSliceDiscovery:
    """A discovery source: `run(on_change)` calls `on_change` with the sorted URLs of the
    target Service's ready endpoints, at start and whenever they change."""

    def __init__(
        self,
        target: DiscoveryTarget,
        api_client: kubernetes.client.ApiClient | None = None,
        *,
        watch_timeout_seconds: int = 60,
        max_backoff_seconds: float = 30.0,
    ):
        self.target = target
        self.api = kubernetes.client.DiscoveryV1Api(api_client or load_api_client())
        self.watch_timeout_seconds = watch_timeout_seconds
        self.max_backoff_seconds = max_backoff_seconds

    async def run(self, on_change: Callable[[list[str]], None]) -> None:
        loop = asyncio.get_running_loop()
        found: asyncio.Queue[list[str]] = asyncio.Queue()
        stop = threading.Event()

        def publish(urls: list[str]) -> None:
            try:
                loop.call_soon_threadsafe(found.put_nowait, urls)
            except RuntimeError:  # the loop is closed: nobody listens any more
                stop.set()

        # A daemon: cancelling `run` sets `stop`, and the thread ends when its current
        # request returns, without holding up the process's exit.
        thread = threading.Thread(
            target=self._follow,
            args=(publish, stop),
            name=f"discovery-{self.target.service}",
            daemon=True,
        )
        thread.start()
        last: list[str] | None = None
        try:
            while True:
                urls = await found.get()
                if urls != last:
                    last = urls
                    on_change(list(urls))
        finally:
            stop.set()

    # --- in the thread ------------------------------------------------------------------------

    def _follow(self, publish: Callable[[list[str]], None], stop: threading.Event) -> None:
        backoff = 1.0
        while not stop.is_set():
            try:
                slices, version = self._list()
                publish(ready_urls(slices.values(), self.target.port_name))
                backoff = 1.0
                while not stop.is_set():
                    version = self._watch(slices, version, publish, stop)
            except _Expired:
                continue
            except (ApiException, urllib3.exceptions.HTTPError, OSError, ValueError) as error:
                logger.warning(
                    "discovery of %s/%s failed, retrying in %gs: %s",
                    self.target.namespace,
                    self.target.service,
                    backoff,
                    error,
                )
            except Exception:
                # Whatever else goes wrong, discovery must go on: the router keeps the
                # backends it knows and tries again.
                logger.exception(
                    "discovery of %s/%s failed, retrying in %gs",
                    self.target.namespace,
                    self.target.service,
                    backoff,
                )
            else:
                continue
            stop.wait(backoff)
            backoff = min(backoff * 2, self.max_backoff_seconds)

    def _list(self) -> tuple[dict[str, dict[str, Any]], str]:
        # Raw JSON (not the client's models): the same dicts the watch events carry.
        response: Any = self.api.list_namespaced_endpoint_slice(
            self.target.namespace,
            label_selector=self.target.label_selector,
            _preload_content=False,
            _request_timeout=30,
        )
        body = json.loads(response.data)
        slices = {item["metadata"]["name"]: item for item in body.get("items") or []}
        return slices, body["metadata"]["resourceVersion"]

    def _watch(
        self,
        slices: dict[str, dict[str, Any]],
        version: str,
        publish: Callable[[list[str]], None],
        stop: threading.Event,
    ) -> str:
        """One watch request from `version`, applying each event to `slices`; returns the
        version to resume from."""
        try:
            response = self._open_watch(version)
        except ApiException as error:
            if error.status == GONE:  # refused before streaming (servers differ in this)
                raise _Expired() from None
            raise
        try:
            for line in iter_resp_lines(response):
                if stop.is_set():
                    break
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == GONE:
                        raise _Expired()
                    raise ApiException(status=obj.get("code"), reason=obj.get("message"))
                version = obj.get("metadata", {}).get("resourceVersion") or version
                if kind == "BOOKMARK":
                    continue
                name = obj["metadata"]["name"]
                if kind == "DELETED":
                    slices.pop(name, None)
                else:
                    slices[name] = obj
                publish(ready_urls(slices.values(), self.target.port_name))
        finally:
            response.release_conn()
        return version

    def _open_watch(self, version: str) -> Any:
        return self.api.list_namespaced_endpoint_slice(
            self.target.namespace,
            label_selector=self.target.label_selector,
            watch=True,
            allow_watch_bookmarks=True,
            resource_version=version,
            timeout_seconds=self.watch_timeout_seconds,
            _preload_content=False,
            # The server ends the watch; a read this much longer means the connection is dead.
            _request_timeout=(10, self.watch_timeout_seconds + 30),
        )
